"""The model runtime: config, decoder layers, attention over the paged cache, loading."""
