"""Running a step on the model: the step functions that are exported and compiled (`step`,
`variant_step`, `prompt_logprobs`), the `ModelRunner` that packs rows into buckets and runs them,
the scripted runner for tests, and the torch thread settings."""
