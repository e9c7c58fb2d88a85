"""Building blocks of the models: norms, activations, rotary embeddings, paged attention."""
