"""The benchmarks: each module measures and writes its table and JSON; what one needs of the
product it imports from `hicache` and `hicache_server`. Run from the repository root as
`python -m benchmarks.<name>` (the Makefile's `bench*` targets do)."""
