"""The pooling routes: /v1/embeddings (pooled hidden states, the checkpoint's pooling)
and /v1/rerank, /v1/score (a sequence-classification head over query-document
pairs), all prefill-only work batched by the engine."""
