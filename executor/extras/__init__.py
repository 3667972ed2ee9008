"""Outputs beyond the next token: prompt logprobs, scores of given tokens, hidden states and
pooled embeddings, asked per request (`RowOutputs`) and returned Ragged over the batch."""
