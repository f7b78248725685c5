"""The 512-rank projections of `gflow model` as ranges over the inputs that drive them, beside
GradientFlow's published speedups (410.2x AlexNet, 434.1x ResNet-50 on 512 GPUs).

    python bench/model_ranges.py      # 64 nodes x 8 GPUs, 56 Gbit/s, bench/results/calibration_shm.json

Each technique's efficiency is computed at every corner of
- gflow's own cost per ring step (py_step): 5 us and 20 us,
- link efficiency: 85% and 100% of the link's 56 Gbit/s,
- the backward share of compute (what overlap can hide communication behind): 0.5 and 2/3,
and reported as the lowest and highest, for device buffers handed to a CUDA-aware MPI ("direct") and
staged through host memory ("staged"). The model's other inputs are gflow/tools/cost_model.py's.
"""

import argparse
import itertools
import os

from gflow.tools import cost_model as model

HERE = os.path.dirname(os.path.abspath(__file__))
PAPER = {"alexnet": 410.2, "resnet50": 434.1}
PY_STEP = (5e-6, 20e-6)
LINK_EFFICIENCY = (0.85, 1.0)
BACKWARD_SHARE = (0.5, 2 / 3)


def ranges(workload: str, base, ranks: int, per_node: int, link: float, transport: str) -> dict:
    """{technique: (lowest efficiency, highest)} over the corners."""
    sizes = model.workload_sizes(workload)
    v100 = model.V100[workload]
    compute_s = v100["batch"] / v100["images_per_s"]
    found: dict = {}
    for py_step, efficiency, backward in itertools.product(PY_STEP, LINK_EFFICIENCY, BACKWARD_SHARE):
        cal = model.Calibration(**{**vars(base), "py_step": py_step, "uncrowded": None})
        cal = model.cluster(cal, link * efficiency, 5e-6, per_node, transport=transport)
        rows = model.predict(sizes, ranks, per_node, compute_s, v100["batch"], cal, backward_share=backward)
        for row in rows:
            low, high = found.get(row["technique"], (1.0, 0.0))
            found[row["technique"]] = (min(low, row["efficiency"]), max(high, row["efficiency"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=os.path.join(HERE, "results", "calibration_shm.json"))
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--link", default="56gbit")
    args = parser.parse_args()
    base = model.Calibration.load(args.calibration)
    link = model.parse_rate(args.link)
    table = {
        (workload, transport): ranges(workload, base, args.ranks, args.ranks_per_node, link, transport)
        for workload in PAPER
        for transport in ("direct", "staged")
    }
    print(
        f"{args.ranks} ranks, {args.ranks_per_node} per node, {args.link}; py_step {PY_STEP[0] * 1e6:g}-"
        f"{PY_STEP[1] * 1e6:g} us, link efficiency {LINK_EFFICIENCY[0]:.0%}-{LINK_EFFICIENCY[1]:.0%}, "
        f"backward share {BACKWARD_SHARE[0]:g}-{BACKWARD_SHARE[1]:.2f}; calibration {base.source}\n"
    )
    print("| technique | AlexNet, direct | AlexNet, staged | ResNet-50, direct | ResNet-50, staged |")
    print("|---|---|---|---|---|")
    for technique in table[("alexnet", "direct")]:
        cells = []
        for workload in PAPER:
            for transport in ("direct", "staged"):
                low, high = table[(workload, transport)][technique]
                cells.append(f"{low:.0%}-{high:.0%} ({low * args.ranks:.0f}-{high * args.ranks:.0f}x)")
        print(f"| {technique} | " + " | ".join(cells) + " |")
    paper = [f"{PAPER[w] / args.ranks:.0%} ({PAPER[w]:g}x)" for w in PAPER]
    print(f"| GradientFlow, published | {paper[0]} | | {paper[1]} | |")


if __name__ == "__main__":
    main()
