"""HTTP plumbing shared by every route family: state, auth, body reading, SSE, error envelopes."""
