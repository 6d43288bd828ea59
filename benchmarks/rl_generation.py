"""RL generation benchmark: the tiny chain's RL sampling with each engine, and the padding that
length-sorted micro batches save.

    python3 benchmarks/rl_generation.py [--model DIR] [--device cpu|cuda] [--rollouts N] [--out FILE]
                                        [--results benchmarks/RESULTS.md]

It takes pipeline/configs/tiny.yaml's rl stage as it is (prompts per process per rollout,
n_samples_per_prompt, max_new_tokens, temperature, top_p, micro_rollout_batch_size, micro_batch_size)
and samples one process's share of N rollouts of digits prompts with the padded engine (before)
and the continuous one (after, where the installed transformers has it), and on a GPU the padded
engine both ways (padded: the static cache and compiled step it takes there; padded-generate:
transformers' `generate`; --static adds the uncompiled static cache on a CPU), alternating so that all
see the same machine load, sampling and greedy (the held-out evaluation); it reports the best and
the median rollout of each (on a shared machine the best is closest to the engine's own cost). Tokens/s counts the
response tokens (eos included) per second of `stages.generation.generate`: what metrics.jsonl's
generate_tokens_per_s counts. The padding numbers are the processed (padded) tokens of the scoring
passes and training micro batches of the sampled rollouts, in sampling order (before) and length
sorted (after), computed from the sequences the padded engine sampled.

--model: a trained policy (e.g. runs/tiny/sft/model after `make pipeline`): its completions have the
lengths RL sees; without it the built-in tiny Llama's random weights (mostly max_new_tokens long).
Writes a JSON result (default benchmarks/results/rl-generation-<device>-<date>[-<suffix>].json) and,
with --results, its table between RESULTS.md's markers of that name (without the date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rl_generation.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="policy folder (default: the built-in tiny Llama, random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rollouts", type=int, default=5, help="rollouts per engine and mode (median reported)")
    parser.add_argument("--max-new-tokens", type=int, help="instead of the stage's (a longer tail of lengths)")
    parser.add_argument("--prompts", type=int, help="prompts per process per rollout, instead of the stage's")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/rl-generation-DEVICE-DATE.json)")
    parser.add_argument("--out-suffix", help="appended to the default result file's name")
    parser.add_argument("--results", help="RESULTS.md to write the table into (between its markers)")
    parser.add_argument("--static", action="store_true",
                        help="on a CPU, also the padded engine on a static KV cache (padded-static; uncompiled)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, GenerationMixin

    from core import batching, tiny
    from core.config import load_pipeline
    from stages import compat, data, generation, models

    stage = next(s for s in load_pipeline("tiny").stages if s.kind == "ppo")
    if args.max_new_tokens:
        stage = stage.model_copy(update={"max_new_tokens": args.max_new_tokens})
    processes = 2  # tiny.yaml's tasks_per_node: each process samples its share
    per_process = args.prompts or stage.rollout_batch_size // processes
    folder = args.model or str(tiny.materialize("tiny-llama", REPO / "benchmarks" / "out" / "builtin"))
    tokenizer = models.load_tokenizer(folder)
    attention = models.attention_implementation(stage.attention, args.device.startswith("cuda"), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention).to(args.device).eval()
    rows = dict(tiny.digits_splits())["train"]
    rng = random.Random(0)
    # label -> (stage.generation, generate's decoding): "padded" decodes as the stage would on this device
    # (a static cache and a compiled step on a GPU with transformers 5.x); padded-generate is transformers'
    # own loop beside it there, padded-static the static cache on a CPU when asked for.
    variants = {"padded": ("padded", None)}
    if generation.padded_decoding(args.device, stage.zero_stage) == "static":
        variants["padded-generate"] = ("padded", "dynamic")
    elif args.static and compat.static_decoding_unavailable() is None:
        variants["padded-static"] = ("padded", "static")
    if compat.continuous_batching_available(GenerationMixin, 2):
        variants["continuous"] = ("continuous", None)
    engines = list(variants)

    def rollout_prompts():
        chosen = rng.sample(rows, per_process)
        return [SimpleNamespace(ids=data.encode_prompt(tokenizer, r["prompt"], stage.data))
                for r in chosen for _ in range(stage.n_samples_per_prompt)]

    measured = {(engine, mode): [] for engine in engines for mode in ("sampling", "greedy")}
    padded_sequences = []
    generation.generate(SimpleNamespace(module=model), rollout_prompts()[:8], tokenizer=tokenizer,  # warm-up
                        stage=stage.model_copy(update={"generation": "padded"}), device=args.device)
    for index in range(args.rollouts):
        prompts = rollout_prompts()
        for mode in ("sampling", "greedy"):
            for engine in (engines if index % 2 == 0 else engines[::-1]):
                torch.manual_seed(index)
                started = time.perf_counter()
                kind, decoding = variants[engine]
                out = generation.generate(SimpleNamespace(module=model), prompts, tokenizer=tokenizer,
                                          stage=stage.model_copy(update={"generation": kind}), device=args.device,
                                          greedy=mode == "greedy", decoding=decoding)
                seconds = time.perf_counter() - started
                tokens = sum(len(r) for r in out)
                measured[engine, mode].append({"seconds": seconds, "tokens": tokens})
                if engine == "padded" and mode == "sampling":
                    padded_sequences.append([p.ids + r for p, r in zip(prompts, out)])

    def padding(size: int, ordered: bool) -> float:
        """Share of processed tokens that are padding, over the sampled rollouts."""
        real = processed = 0
        for sequences in padded_sequences:
            lengths = [len(s) for s in sequences]
            chunks = (batching.by_length(range(len(lengths)), lengths, size) if ordered else
                      [list(range(k, min(k + size, len(lengths)))) for k in range(0, len(lengths), size)])
            real += sum(lengths)
            processed += sum(len(c) * max(lengths[i] for i in c) for c in chunks)
        return 1 - real / processed

    result = {
        "date": datetime.date.today().isoformat(),
        "arguments": " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"device": args.device, "cpu": platform.processor() or platform.machine(),
                    "cores": __import__("os").cpu_count(),
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "versions": compat.versions(),
        "model": args.model or "builtin:tiny-llama (random weights)",
        "setting": {"sequences_per_rollout_per_process": per_process * stage.n_samples_per_prompt,
                    "max_new_tokens": stage.max_new_tokens, "micro_rollout_batch_size": stage.micro_rollout_batch_size,
                    "micro_batch_size": stage.micro_batch_size, "temperature": stage.temperature,
                    "top_p": stage.top_p, "rollouts": args.rollouts},
        "generation": {
            f"{engine}/{mode}": {
                "tokens_per_s_median": statistics.median(m["tokens"] / m["seconds"] for m in runs),
                "tokens_per_s_best": max(m["tokens"] / m["seconds"] for m in runs),
                "seconds_median": statistics.median(m["seconds"] for m in runs),
                "seconds_best": min(m["seconds"] for m in runs),
                "seconds_first": runs[0]["seconds"],  # a compiled step's compile time is in here
                "response_length_mean": sum(m["tokens"] for m in runs) / len(runs) / (
                    per_process * stage.n_samples_per_prompt),
                "runs": runs,
            } for (engine, mode), runs in measured.items()},
        "padding_share": {
            "scoring": {"in_order": padding(stage.micro_rollout_batch_size, False),
                        "length_sorted": padding(stage.micro_rollout_batch_size, True)},
            "training": {"in_order": padding(stage.micro_batch_size, False),
                         "length_sorted": padding(stage.micro_batch_size, True)},
        },
    }
    name = f"rl-generation-{args.device}-{result['date']}" + (f"-{args.out_suffix}" if args.out_suffix else "")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    print(table)
    print(f"written: {out}")
    if args.results:
        write_between_markers(Path(args.results), table, name.replace(f"-{result['date']}", ""))
    return 0


def markdown(result: dict) -> str:
    s, v, m = result["setting"], result["versions"], result["machine"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores"
    lines = [
        f"### RL generation, {m['device']} ({where}), {result['date']}",
        "",
        f"`python3 benchmarks/rl_generation.py {result['arguments']}`: tiny.yaml's rl stage, one process's "
        f"share of a rollout ({s['sequences_per_rollout_per_process']} sequences, max_new_tokens "
        f"{s['max_new_tokens']}, micro_rollout_batch_size {s['micro_rollout_batch_size']}), {result['model']}; "
        f"best and median of {s['rollouts']} rollouts (the machine is shared: the best is the engine's own "
        f"cost); torch {v['torch']}, transformers {v['transformers']}.",
        "",
        "| engine | mode | response tokens/s: best (median) | seconds per rollout: best (median) | "
        "mean response length |",
        "|---|---|---:|---:|---:|",
    ]
    for name, g in result["generation"].items():
        engine, mode = name.split("/")
        lines.append(f"| {engine} | {mode} | {g['tokens_per_s_best']:,.0f} ({g['tokens_per_s_median']:,.0f}) | "
                     f"{g['seconds_best']:.3f} ({g['seconds_median']:.3f}) | {g['response_length_mean']:.2f} |")
    p = result["padding_share"]
    lines += [
        "",
        "| padding share of processed tokens | in sampling order | length sorted |",
        "|---|---:|---:|",
        f"| scoring passes (chunks of {s['micro_rollout_batch_size']}) | {p['scoring']['in_order']:.1%} | "
        f"{p['scoring']['length_sorted']:.1%} |",
        f"| training micro batches ({s['micro_batch_size']} rows) | {p['training']['in_order']:.1%} | "
        f"{p['training']['length_sorted']:.1%} |",
    ]
    return "\n".join(lines)


def write_between_markers(path: Path, table: str, key: str) -> None:
    """Put the table between the markers named `key` (added at the end the first time); the rest is kept."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        text = f"{head}{start}\n{table}\n{end}{tail}"
    else:
        text = f"{text.rstrip()}\n\n{start}\n{table}\n{end}\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
