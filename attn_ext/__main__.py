"""``python -m attn_ext``: environment report, self-check and a quick timing.

1. Prints the attn_ext and torch versions, the local devices, and which
   ``attn_ext::*`` operators have a kernel for CPU and for CUDA.
2. Checks every public function on every local device, at float32 and
   bfloat16, forward and backward, against a float64 ground truth computed on
   the same (rounded) inputs. A check passes when attn_ext's max abs error is
   at most twice the error of the plain PyTorch reference run at the input
   dtype (FlashAttention's rule), plus a floor of a few float32 ulps.
3. Checks every class and function of ``attn_ext.compat`` against its document's code
   (reproduced in :mod:`attn_ext.testing.documents`): both built with the same arguments,
   ours loaded strictly from the document's state dict, forward output and the gradients of
   every input and parameter compared in float64 (to the document in float64) and in float32
   (to the document in float64, within twice the document's own float32 error).
4. Times attn_ext against ``torch.nn.functional.scaled_dot_product_attention``
   at a moderate size, and the fused CBAM spatial gate against the same gate in plain torch,
   and prints the ratios.

Exit status is 1 when any check fails. ``--no-bench`` skips the timing,
``--device cpu`` restricts to one device.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Sequence

import torch

import attn_ext
from attn_ext.testing.selfcheck import run_checks
from attn_ext.testing.selfcheck_compat import run_compat_checks
from attn_ext.testing.selftime import run_bench, run_spatial_bench

# --------------------------------------------------------------------------- environment


def local_devices() -> List[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return devices


def print_environment(devices: Sequence[torch.device]) -> None:
    print(f"attn_ext {getattr(attn_ext, '__version__', 'unknown')}  ({attn_ext.__file__})")
    print(f"torch    {torch.__version__}  (CUDA build: {torch.version.cuda or 'no'})")
    for dev in devices:
        if dev.type == "cuda":
            for i in range(torch.cuda.device_count()):
                print(f"device   cuda:{i}  {torch.cuda.get_device_name(i)}")
        else:
            print(
                f"device   cpu  ({torch.get_num_threads()} threads, "
                f"{attn_ext._C.cpu_block_kernels()} block products)"
            )


def registered_ops() -> List[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attn_ext::"))


def print_ops() -> None:
    ops = registered_ops()
    if not ops:
        print("\nno attn_ext::* operators are registered (is attn_ext._C built?)")
        return
    width = max(len(op) for op in ops)
    print(f"\n{'operator'.ljust(width)}  CPU  CUDA")
    for op in ops:
        # computed: what the key runs, a CompositeExplicitAutograd kernel included
        has = [
            torch._C._dispatch_has_computed_kernel_for_dispatch_key(op, key)
            for key in ("CPU", "CUDA")
        ]
        print(f"{op.ljust(width)}  " + "  ".join(("yes" if h else "-").ljust(4) for h in has))


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn_ext", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], help="only this device (default: all local)"
    )
    p.add_argument("--no-bench", action="store_true", help="skip the timing table")
    p.add_argument("--bench-seqlen", type=int, default=1024)
    p.add_argument("--bench-repeats", type=int, default=5)
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every check, not only failures"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = [d for d in local_devices() if args.device in (None, d.type)]
    print_environment(devices)
    print_ops()
    ok = run_checks(devices, args.verbose)
    ok = run_compat_checks(devices) and ok
    if not args.no_bench:
        run_bench(devices, args.bench_seqlen, args.bench_repeats)
        run_spatial_bench(devices, args.bench_repeats)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
