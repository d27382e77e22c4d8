"""Checkpoint to Core ML package: the conversions of one build task
(`joint`, `chunks`), the pass pipeline (`passes`), INT4 palettization
(`palettize`, and its benchmark `bench_palettize`) and the decode packages
composed from four-chunk programs (`compose`)."""
