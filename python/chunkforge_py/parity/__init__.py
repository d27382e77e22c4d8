"""`chunkforge parity`: the four-chunk reference against every layout, the
transformers oracle (`oracle`) and each package's own program (`programs`),
step by step (`run`), judged by the rules in `verdicts`."""
