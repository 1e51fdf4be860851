"""tracktron's benchmarks: `python -m bench.run` (CPU, rewrites bench/RESULTS.md), bench/gpu.sh (GPU)."""
