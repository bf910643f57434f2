"""A request's life after the step (pure Python): its sequence, the token and string stops,
the incremental detokenizer, the per-request output stream and the output types."""
