"""Engines reached from outside the process: SGLang servers (`sglang`), the least-load
`Router` over several engines, OpenAI-compatible API models (`openai_engine`) and the
deterministic `ScriptedEngine` of the tests.
"""
