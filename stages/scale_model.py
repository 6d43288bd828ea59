"""Writes a scale model (pipeline/scale.py): a random-init model built from a narrowed
config.json, with the real model's tokenizer or a byte-level stand-in, in Hugging Face format.

`python -m stages.scale_model < REQUEST`, REQUEST being JSON {"folder": where, "description":
pipeline.scale.describe's dict}; prints one line saying what it wrote. A child process of the
`pipeline` command, because it imports torch and transformers. The weights are the same on
every call (the description's seed), so scale-model runs at different layouts start alike.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core import tiny
from core.runfolder import DESCRIPTION_FILE
from core.shapes import count_text

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # Llama's ids 0, 1, 2


def byte_tokenizer():
    """A tokenizer with one token per byte (and Llama's three special tokens): any text
    tokenises, with no vocabulary to learn, in 259 ids, fewer than any real model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                        special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        model_input_names=["input_ids", "attention_mask"])
    tokenizer.chat_template = tiny.CHAT_TEMPLATE
    return tokenizer


def write(folder: Path, description: dict) -> str:
    """Build and save the model; returns the line that says what was written."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = dict(description["config"])
    if description["tokenizer"]:
        tokenizer = AutoTokenizer.from_pretrained(description["tokenizer"])
        said = f"the real tokenizer ({description['tokenizer']})"
    else:
        tokenizer = byte_tokenizer()
        config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
        said = ("a byte-level stand-in tokenizer: the real one is not on this machine, and text makes about 4x "
                "more tokens than with it")
    built = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(description["seed"])
    model = AutoModelForCausalLM.from_config(built)  # fp32, torch's default dtype
    params = sum(p.numel() for p in model.parameters())

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _keep_rope_theta_readable(tmp / "config.json", description["config"])
        (tmp / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2) + "\n")

    tiny.write_atomically(folder, save)
    return (f"scale model of {description['source']}: {count_text(params)} params, {built.num_hidden_layers} layers, "
            f"{built.num_attention_heads} heads ({built.num_key_value_heads} KV), head dim {description['head_dim']}, "
            f"hidden {built.hidden_size}, vocab {built.vocab_size}; {said}; in {folder}")


def _keep_rope_theta_readable(path: Path, source: dict) -> None:
    """transformers 5 writes rope_theta under rope_parameters, where 4.x does not look (it would
    use its default 10000): write it at the top too, so both stacks train with the real one."""
    from core.shapes import from_config_json

    written = json.loads(path.read_text())
    theta = from_config_json(written).rope_theta or from_config_json(source).rope_theta
    if theta is not None and "rope_theta" not in written:
        written["rope_theta"] = theta
        path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def main() -> int:
    request = json.load(sys.stdin)
    print(write(Path(request["folder"]), request["description"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
