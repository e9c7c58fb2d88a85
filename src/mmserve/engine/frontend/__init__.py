"""The API process's engine side: core client, output processing, detokenizing, offline LLM."""
