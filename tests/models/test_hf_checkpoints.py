"""Local Hugging Face checkpoints of four architectures, each with a real BPE tokenizer trained
here: loaded by ``model.path``, trained for a few async steps, evaluated, saved and reloaded.

Llama has no pad token and a tokenizer that adds BOS itself; Qwen2 pads with its EOS, has a chat
template and a generation config with a second EOS id; Mistral has a distinct pad token; GPT-2's
BOS is its EOS and it has no pad token. Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import QUIET
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from relayrl import cli
from relayrl.config import load_config
from relayrl.engines.native import sample_chunk
from relayrl.envs.arithmetic import AdditionTask
from relayrl.executors.trainer import Trainer
from relayrl.models.lm import PromptCodec, load_codec, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# architecture: special tokens (bos, eos, pad; None: the tokenizer has none)
SPECIALS = {
    "llama": ("<s>", "</s>", None),
    "qwen2": (None, "<|endoftext|>", "<|endoftext|>"),
    "mistral": ("<s>", "</s>", "<pad>"),
    "gpt2": ("<|endoftext|>", "<|endoftext|>", None),
}
ARCHITECTURES = tuple(SPECIALS)
ARITH = Path(__file__).resolve().parents[2] / "configs" / "arith.yaml"


def _corpus() -> list[str]:
    task = AdditionTask(3, True, 10)
    problems = task.sample(400, random.Random(0))
    return [p.prompt + p.answer for p in problems] + ["user assistant system\n"]


def _tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on arithmetic text, with ``arch``'s special tokens."""
    bos, eos, pad = SPECIALS[arch]
    specials = [t for t in dict.fromkeys([bos, eos, pad]) if t is not None]
    if arch == "qwen2":
        specials += ["<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if arch == "llama":  # Llama's tokenizer puts BOS first by its own rule
        bpe.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad
    )
    if arch == "qwen2":
        tokenizer.chat_template = CHATML
    return tokenizer


def _model(arch: str, tokenizer: PreTrainedTokenizerFast):
    """A tiny random causal LM of ``arch``."""
    torch.manual_seed(0)
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **ids))
    sizes = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
    }
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=True, **ids))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes, tie_word_embeddings=True, **ids))
    return MistralForCausalLM(MistralConfig(**sizes, tie_word_embeddings=False, **ids))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """One saved checkpoint (model, tokenizer, generation config) per architecture."""
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for arch in ARCHITECTURES:
        tokenizer = _tokenizer(arch)
        model = _model(arch, tokenizer)
        if arch == "qwen2":  # a chat model ends its turn with <|im_end|> as well
            model.generation_config = GenerationConfig(
                eos_token_id=[
                    tokenizer.convert_tokens_to_ids("<|im_end|>"),
                    tokenizer.eos_token_id,
                ],
            )
        model.save_pretrained(root / arch)
        tokenizer.save_pretrained(root / arch)
        paths[arch] = root / arch
    return paths


def test_each_tokenizer_loads_and_its_codec_pads_stops_and_adds_bos_by_its_rule(checkpoints):
    llama = PromptCodec(load_tokenizer(str(checkpoints["llama"])))
    eos = llama.tokenizer.eos_token_id
    assert llama.tokenizer.pad_token_id is None and llama.pad_id == eos  # pads with EOS
    ids = llama.encode("12+34=")
    assert ids[0] == llama.tokenizer.bos_token_id and ids.count(ids[0]) == 1  # BOS once
    gpt2 = PromptCodec(load_tokenizer(str(checkpoints["gpt2"])))
    assert gpt2.bos_id is None and gpt2.encode("12+34=")[0] != gpt2.stop_ids[0]  # BOS is EOS
    mistral = PromptCodec(load_tokenizer(str(checkpoints["mistral"])))
    assert mistral.pad_id == mistral.tokenizer.convert_tokens_to_ids("<pad>") != eos
    qwen = PromptCodec(
        load_tokenizer(str(checkpoints["qwen2"])),
        chat_template=True,
        model_path=str(checkpoints["qwen2"]),
    )
    end_of_turn = qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert qwen.stop_ids == (qwen.tokenizer.eos_token_id, end_of_turn)
    assert qwen.pad_id == qwen.tokenizer.eos_token_id  # pad equal to EOS
    text = qwen.tokenizer.decode(qwen.encode("12+34="))
    assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="task.chat_template=true.*no chat template"):
        PromptCodec(llama.tokenizer, chat_template=True)


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(checkpoints):
    codec = PromptCodec(load_tokenizer(str(checkpoints["gpt2"])), stop_strings=["+3"])
    tokens = codec.tokenizer("12+34=5", add_special_tokens=False)["input_ids"]
    keep = codec.stop_length(tokens)
    assert "+3" in codec.tokenizer.decode(tokens[:keep])
    assert "+3" not in codec.tokenizer.decode(tokens[: keep - 1])
    assert codec.stop_length(codec.tokenizer("12=", add_special_tokens=False)["input_ids"]) is None


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_engine_generates_what_hugging_face_generate_does(checkpoints, arch):
    """Greedy tokens of a left-padded batch equal ``generate``'s for each prompt alone."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch]).eval()
    codec = PromptCodec(load_tokenizer(str(checkpoints[arch])))
    prompts = [codec.encode("12+34="), codec.encode("7+8=")]
    chunk = sample_chunk(model, prompts, 6, stop_ids=(-1,), pad_id=codec.pad_id, greedy=True)
    for prompt, tokens in zip(prompts, chunk.tokens, strict=True):
        expected = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=codec.pad_id,
        )[0, len(prompt) :]
        assert tokens == expected.tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_trained_checkpoint_reloads_with_identical_logits(checkpoints, arch, tmp_path):
    cfg = load_config(None, [f"model.path={checkpoints[arch]}", "trainer.lr=0.01", *QUIET])
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    _, codec = load_codec(cfg)
    batch = _rollouts(cfg, codec)
    assert trainer.train_step(batch).stepped
    assert any(
        not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)
    )
    trainer.save_pretrained(str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.from_numpy(batch.tokens)
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=tokens).logits
        assert torch.equal(reloaded(input_ids=tokens).logits, expected)
    assert load_tokenizer(str(tmp_path)).get_vocab() == trainer.tokenizer.get_vocab()


def test_gradient_checkpointing_takes_the_same_step(checkpoints):
    base = [f"model.path={checkpoints['llama']}", "trainer.lr=0.01", *QUIET]
    plain = Trainer(load_config(None, base))
    recomputed = Trainer(load_config(None, [*base, "trainer.gradient_checkpointing=true"]))
    assert recomputed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    batch = _rollouts(plain.cfg, plain.codec)
    plain.train_step(batch)
    recomputed.train_step(batch)
    pairs = zip(plain.model.parameters(), recomputed.model.parameters(), strict=True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_relayrl_trains_and_evaluates_each_checkpoint(checkpoints, arch, tmp_path, capsys):
    """``relayrl train`` (async, a few steps) from the checkpoint, then ``relayrl eval`` on the
    run; Qwen2 trains through its chat template."""
    chat = ["task.chat_template=true"] if arch == "qwen2" else []
    run = tmp_path / "run"
    code = cli.main(
        [
            "train",
            str(ARITH),
            "--run-dir",
            str(run),
            f"model.path={checkpoints[arch]}",
            "mode=async",
            "steps=3",
            "warm_start.max_steps=0",
            "generator.prompts_per_step=4",
            "generator.group_size=2",
            "task.heldout_size=8",
            "task.digits=1",
            "log.eval_every=0",
            *chat,
            *QUIET,
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["samples"]["accounted"] and summary["samples"]["generated"] > 0
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    capsys.readouterr()
    eval_args = ["eval", str(run), "--data", str(data), "--max-new-tokens", "4", "--workers", "1"]
    assert cli.main(eval_args + (["--chat-template"] if chat else [])) == 0
    assert "pass@1" in capsys.readouterr().out


def _rollouts(cfg, codec):
    """Two groups of two sampled completions of addition prompts, with rewards 1 and 0."""
    from relayrl.executors.generator import Generator

    generator = Generator(cfg)
    task = AdditionTask(1, True, 4)
    problems = task.sample(2, random.Random(1))
    batch = generator.complete(
        [codec.encode(p.prompt) for p in problems],
        [p.answer for p in problems],
        k=2,
        max_new_tokens=4,
    )
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0]).numpy()
    return batch
