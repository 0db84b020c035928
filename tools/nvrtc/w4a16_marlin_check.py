#!/usr/bin/env python3
"""Compile-check benchmarks/w4a16_marlin.py's kernel with NVRTC, as MLX's ``mx.fast.cuda_kernel`` builds it.

    .venv/bin/python tools/nvrtc/w4a16_marlin_check.py                 # the default variants, sm_90a
    .venv/bin/python tools/nvrtc/w4a16_marlin_check.py --all --arch sm_80
    .venv/bin/python tools/nvrtc/w4a16_marlin_check.py --kernel native      # MLX's packed layout, no repack
    NVRTC_EXTRA="--ptxas-options=-v" .venv/bin/python tools/nvrtc/w4a16_marlin_check.py --only "MT=4 NB=2 XB=2 GS=64 SPLIT=0 REDUCE=0"

Setup of /tmp/nvrtc as in tools/nvrtc/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))

import check  # noqa: E402
import w4a16_marlin as w4m  # noqa: E402

#: The dtype of each kernel input (in ``LAYOUTS[layout].input_names`` order; ``locks`` is 1-D).
INPUT_DTYPES = {
    "repacked": ["bfloat16", "uint32", "bfloat16", "int32"],
    "native": ["bfloat16", "uint32", "bfloat16", "bfloat16", "int32"],
}


def cases(all_variants: bool) -> list[tuple[str, w4m.Plan, int, bool, bool]]:
    """(label, plan, group size, split, reduce) for every variant to compile."""
    out = []
    nbs = (1, 2, 4) if all_variants else (1, 2)
    gss = w4m.GROUP_SIZES
    for mt in (1, 2, 4):
        for nb in nbs:
            for gs in gss:
                for split, reduce in ((False, False), (True, True), (True, False)):
                    if not all_variants and (gs == 128 or (nb == 1 and mt > 1) or (split and not reduce)):
                        continue
                    for xbuf in (1, 2):
                        if not all_variants and xbuf == 1 and mt < 4:
                            continue
                        label = f"MT={mt} NB={nb} XB={xbuf} GS={gs} SPLIT={int(split)} REDUCE={int(reduce)}"
                        out.append((label, w4m.Plan(mt, nb, 4, 2 if split else 1, reduce, xbuf), gs, split, reduce))
    return out


def native_cases(all_variants: bool) -> list[tuple[str, w4m.Plan, int, bool, bool]]:
    """(label, plan, group size, split, reduce) for every native variant to compile."""
    out = []
    for mt in (1, 2, 4):
        for nb in (1, 2, 4) if all_variants else (1, 2):
            for warps in (2, 4, 8) if all_variants else (4,):
                for gs in w4m.GROUP_SIZES:
                    for split, reduce in ((False, False), (True, True), (True, False)):
                        if not all_variants and (split and not reduce):
                            continue
                        stages = w4m.plan(16 * mt, 4096, 4096, mt=mt, nb=nb, warps=warps, splits=1).stages
                        p = w4m.Plan(mt, nb, warps, 2 if split else 1, reduce, stages=stages)
                        label = f"native MT={mt} NB={nb} W={warps} ST={stages} GS={gs} SPLIT={int(split)} REDUCE={int(reduce)}"
                        out.append((label, p, gs, split, reduce))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every MT, NB in 1/2/4 and group 128 too")
    ap.add_argument("--only", default=None, help="one label, e.g. 'MT=4 NB=2 XB=1 GS=64 SPLIT=1 REDUCE=1'")
    ap.add_argument("--arch", default=check.ARCH)
    ap.add_argument("--dump", default=None, help="write each translation unit here")
    ap.add_argument("--kernel", choices=["repacked", "native", "both"], default="both")
    args = ap.parse_args()
    print(f"NVRTC {check.nvrtc_version()} arch {args.arch}", flush=True)
    failed = 0
    bf = "bfloat16"
    todo = []
    if args.kernel != "native":
        todo += [(c, False) for c in cases(args.all)]
    if args.kernel != "repacked":
        todo += [(c, True) for c in native_cases(args.all)]
    for (label, p, gs, split, reduce), is_native in todo:
        if args.only and label != args.only:
            continue
        layout: w4m.Layout = "native" if is_native else "repacked"
        kern = w4m.LAYOUTS[layout]
        dtypes = INPUT_DTYPES[layout]
        inputs = [(n, 1 if n == "locks" else 2, dt) for n, dt in zip(kern.input_names, dtypes, strict=True)]
        tmpl = w4m.template(p, gs, split, reduce, layout)
        r = check.compile_kernel(
            w4m.kernel_name(p, gs, split, reduce, layout),
            inputs,
            w4m.OUTPUT_NAMES,
            [bf, "float32"],
            kern.source,
            kern.header,
            [(n, v if isinstance(v, (bool, int)) else bf) for n, v in tmpl],
            args.dump,
            args.arch,
        )
        check.report(label, r)
        failed += not r["ok"]
    print("all compiled" if not failed else f"{failed} FAILED", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
