"""Language-model policies: a local Hugging Face checkpoint or a tiny Llama built from a config."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from relayrl.config import Config, ModelConfig


def builtin_tokenizer_dir(name: str = "char") -> Path:
    """Folder of a tokenizer shipped with relayrl."""
    return Path(str(resources.files("relayrl") / "assets" / f"{name}_tokenizer"))


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """A tokenizer from a directory or ``builtin:NAME``; it must define EOS. A missing pad token,
    or one equal to EOS, is fine: attention masks carry the padding (see ``PromptCodec.pad_id``)."""
    folder = builtin_tokenizer_dir(spec.split(":", 1)[1]) if spec.startswith("builtin:") else spec
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.tokenizer={spec!r}: the tokenizer defines no EOS token")
    return tokenizer


class PromptCodec:
    """How prompts become token ids and where completions stop, for one tokenizer and policy.

    - Stop ids: the tokenizer's EOS and every ``eos_token_id`` of the checkpoint's generation
      config (Llama-3-style checkpoints list several).
    - Padding: the tokenizer's pad id, or its EOS when it has none. Every batch carries its
      lengths and attention masks, so a pad id is never read as a token; it may equal EOS.
    - BOS: a plain prompt is encoded by the tokenizer's own rule (``add_special_tokens``), and
      BOS is put first if the tokenizer defines one, distinct from EOS, that its rule left out.
      With ``chat_template`` the prompt is the user turn of the tokenizer's chat template with
      the generation prompt appended, encoded as the template writes it (BOS included or not).
    - Stop strings: ``stop_strings`` and the generation config's; a completion ends with the
      token that completes one (``stop_length``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: bool = False,
        model_path: str | None = None,
        stop_strings: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.chat_template=true, but the tokenizer has no chat template "
                "(set task.chat_template=false, or use a tokenizer with one)"
            )
        generation = _generation_config(model_path)
        extra = generation.eos_token_id if generation is not None else None
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.stop_ids = tuple(dict.fromkeys([tokenizer.eos_token_id, *extra]))
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        )
        bos = tokenizer.bos_token_id
        self.bos_id = bos if bos is not None and bos not in self.stop_ids else None
        strings = list(stop_strings)
        if generation is not None and generation.stop_strings:
            more = generation.stop_strings
            strings += [more] if isinstance(more, str) else list(more)
        self.stop_strings = tuple(dict.fromkeys(s for s in strings if s))

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (see the class docstring for BOS and the chat template)."""
        if self.chat_template:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def encode_lenient(self, text: str) -> tuple[list[int], int]:
        """Like ``encode``, but characters the vocabulary cannot encode are dropped, not fatal.

        Returns the ids and how many characters were dropped (a narrow tokenizer, such as the
        character tokenizer of the arithmetic demo, meeting general text).
        """
        try:
            return self.encode(text), 0
        except Exception:  # tokenizers raise their own exception types for unknown symbols
            kept = []
            for char in text:
                try:
                    self.tokenizer(char, add_special_tokens=False)
                    kept.append(char)
                except Exception:
                    continue
            return self.encode("".join(kept)), len(text) - len(kept)

    def stop_length(self, tokens: Sequence[int]) -> int | None:
        """How many of a completion's ``tokens`` to keep: up to and including the token that
        completes the first stop string, or None when no stop string occurs."""
        if not self.stop_strings or not tokens:
            return None

        def stops(count: int) -> bool:
            text = self.tokenizer.decode(list(tokens[:count]), skip_special_tokens=True)
            return any(stop in text for stop in self.stop_strings)

        if not stops(len(tokens)):
            return None
        low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            if stops(middle):
                high = middle
            else:
                low = middle + 1
        return low


def load_codec(cfg: Config) -> tuple[PreTrainedTokenizerBase, PromptCodec]:
    """The run's tokenizer and its ``PromptCodec`` (``model.tokenizer``, ``task.chat_template``,
    the checkpoint's generation config and ``generator.stop``)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_source)
    codec = PromptCodec(
        tokenizer,
        chat_template=cfg.task.chat_template,
        model_path=cfg.model.path,
        stop_strings=cfg.generator.stop,
    )
    return tokenizer, codec


def _generation_config(model_path: str | None) -> GenerationConfig | None:
    """The checkpoint's ``generation_config.json``, or None when it has none."""
    if model_path is None or not (Path(model_path) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_path)


def build_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> PreTrainedModel:
    """The policy model in fp32 on CPU: loaded from ``cfg.path`` or freshly initialised."""
    # Imported here: the model code costs seconds, and executors that only tokenise (the
    # rewarder) never build a model.
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if cfg.path is not None:
        return AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config)


def token_logprobs(
    model: PreTrainedModel, tokens: Tensor, lengths: Tensor, temperature: float
) -> Tensor:
    """[B, L-1]: log-prob of ``tokens[:, j + 1]`` given the tokens up to ``j``, under
    ``log_softmax(logits / temperature)`` (the distribution the generator samples from), for
    right-padded rows of ``lengths`` real tokens; differentiable unless under ``no_grad``."""
    attention = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(model: PreTrainedModel, precision: str) -> contextlib.AbstractContextManager:
    """A context running ``model``'s forward in ``precision``: bf16 autocast on its device, or
    nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=DTYPES[precision])
