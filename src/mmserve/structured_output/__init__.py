"""Structured output: grammars (JSON schema, regex, choice, Lark) that constrain sampling.

`params.py` is plain Python (what a request carries); `compiler.py` and `manager.py` use
llguidance and live in the engine core, where one matcher per request masks each step.
"""
