"""Memory plans: weight and state bytes per rank of a TP / EP layout, the capacity it leaves, and
`check_fits` (the refusal `trnrt serve` runs before loading weights). See docs/DEPLOY.md."""
