"""Language-model policies: a local Hugging Face checkpoint or a tiny Llama built from a config."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from relayrl.config import ModelConfig


def builtin_tokenizer_dir(name: str = "char") -> Path:
    """Folder of a tokenizer shipped with relayrl."""
    return Path(str(resources.files("relayrl") / "assets" / f"{name}_tokenizer"))


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """A tokenizer from a directory or ``builtin:NAME``, with pad and EOS defined and distinct."""
    folder = builtin_tokenizer_dir(spec.split(":", 1)[1]) if spec.startswith("builtin:") else spec
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.tokenizer={spec!r}: the tokenizer defines no EOS token")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"model.tokenizer={spec!r}: needs a pad token distinct from EOS")
    return tokenizer


def build_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> PreTrainedModel:
    """The policy model in fp32 on CPU: loaded from ``cfg.path`` or freshly initialised."""
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


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a prompt, starting with BOS when the tokenizer has one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_prompt_lenient(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], int]:
    """Like ``encode_prompt``, but characters the vocabulary cannot encode are dropped, not fatal.

    Returns the ids and how many characters were dropped (a narrow tokenizer, such as the
    character tokenizer of the arithmetic demo, meeting general text).
    """
    try:
        return encode_prompt(tokenizer, text), 0
    except Exception:  # tokenizers raise their own exception types for unknown symbols
        kept = []
        for char in text:
            try:
                kept.append(tokenizer(char, add_special_tokens=False)["input_ids"])
            except Exception:
                continue
        ids = [i for piece in kept for i in piece]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + ids, len(text) - len(kept)
