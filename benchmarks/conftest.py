import os
import sys

if os.environ.get("FEDFAST_BENCH_DEVICE", "cuda" if "--gpu" in sys.argv else "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "0")
