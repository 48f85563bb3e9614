"""The API: routes, field parsing, the generation pipeline, the dialects, the error mapping."""
