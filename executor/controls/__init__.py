"""Sampling controls kept per request row (penalties, logit bias, min tokens, token masks)
and the per-step vocab mask: their host shapes, row state, and the logit rules."""
