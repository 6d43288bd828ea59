"""Tables of the step-memory probe's files (benchmarks/gpu/stepmem/sitecustomize.py), torch-free:

    python -m benchmarks.gpu.stepmem_summary DIR [--trace-step 2] [--json OUT]

For each stage process (its case named from the run folder in its command line): the timeline
of points (allocated, reserved, the peaks since the previous point, inactive-split bytes, and
the bytes newly reserved from the device since the previous point), the layouts (segments,
their free blocks and free tail), and the allocator history's intervals with their large events.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

GiB = 1024**3


def case_of(meta: dict) -> str:
    for arg in meta.get("argv", []):
        parts = str(arg).split(os.sep)
        if "runs" in parts:
            i = parts.index("runs")
            if i > 0:
                return parts[i - 1]
    return f"pid{meta.get('pid')}"


def load(folder: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "stepmem-*.json"))):
        with open(path) as f:
            data = json.load(f)
        out[case_of(data.get("meta", {}))] = data
    return out


def _g(value) -> str:
    return "-" if value is None else f"{value / GiB:6.2f}"


def timeline(data: dict) -> list[dict]:
    rows, previous = [], None
    for p in data["points"]:
        row = {k: p.get(k) for k in ("step", "micro", "label")}
        for key in ("allocated", "reserved", "allocated_peak", "reserved_peak", "inactive_split", "segments"):
            row[key] = p.get(key)
        new = None
        if previous is not None and p.get("reserved_total") is not None and previous.get("reserved_total") is not None:
            new = p["reserved_total"] - previous["reserved_total"]
        row["newly_reserved"] = new
        rows.append(row)
        previous = p
    return rows


def report(cases: dict[str, dict], trace_step: int, out=sys.stdout) -> None:
    for case, data in cases.items():
        meta = data.get("meta", {})
        print(f"== {case}: optimizer {meta.get('optimizer')}, ZeRO {meta.get('zero_stage')}, "
              f"groups {meta.get('group_params')}, PYTORCH_CUDA_ALLOC_CONF={meta.get('alloc_conf')}", file=out)
        for error in data.get("errors", []):
            print(f"   error: {error}", file=out)
        print("   step micro point                      alloc  resv | peak since previous: alloc  resv"
              " | inactive-split  newly reserved", file=out)
        for r in timeline(data):
            print(f"   {r['step']:>4} {r['micro']:>5} {r['label']:<24} {_g(r['allocated'])} {_g(r['reserved'])} |"
                  f"                      {_g(r['allocated_peak'])} {_g(r['reserved_peak'])} |"
                  f"         {_g(r['inactive_split'])}          {_g(r['newly_reserved'])}", file=out)
        for layout in data.get("layouts", []):
            segs = "; ".join(f"{s['size']} GiB ({s['allocated']} allocated, {s['blocks']} blocks, free>=16MiB "
                             f"{s['free_ge_16MiB_total']} GiB: {s['free_ge_16MiB'][:4]}, tail {s['tail_free']})"
                             for s in layout["segments"][:3])
            print(f"   layout s{layout['step']} {layout['label']}: {layout['segments_total']} segment(s): {segs}",
                  file=out)
        trace = data.get("trace")
        if trace:
            print(f"   allocator history (events >= {trace['event_mib']} MiB as [action, MiB, offset GiB, "
                  f"MiB mapped just before]; {trace['events_total']} events, highest offset "
                  f"{trace['highest_offset_gib']} GiB):", file=out)
            for i in trace["intervals"]:
                if trace_step and not (i["label"].startswith(f"s{trace_step} ") or
                                       i["label"].startswith(f"s{trace_step - 1} ") and "after step" in i["label"]):
                    continue
                print(f"     after {i['label']}: alloc {i['alloc']} freed {i['free']} mapped {i['mapped']} "
                      f"unmapped {i['unmapped']} GiB; {i['events']}{' +' + str(i['dropped']) if i['dropped'] else ''}",
                      file=out)
        print(file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--trace-step", type=int, default=0, help="show the history of this step only (0: all)")
    args = parser.parse_args(argv)
    cases = load(args.folder)
    if not cases:
        print(f"no stepmem-*.json in {args.folder}")
        return 1
    report(cases, args.trace_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
