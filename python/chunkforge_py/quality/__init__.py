"""What a conversion costs and whether it keeps the model's answers:
`chunkforge eval` (`text`: perplexity, KL and top-1 of each layout's
programs against transformers over a text) and the free-running gate of
`run --against-source` (`gate`: transformers' own greedy tokens)."""
