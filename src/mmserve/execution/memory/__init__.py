"""Start-up memory: device readings, the profile run, KV cache sizing."""
