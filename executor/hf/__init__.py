"""The Hugging Face integration for callers that drive the model themselves (`generate()`):
kvpipe's attention registered as a transformers attention implementation, and the head-group
streaming of the KV store under it."""
