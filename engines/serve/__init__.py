"""Serving an engine over HTTP: ``palaestra serve`` (`serve`), the SGLang-native API
(`http_server`, `sglang_protocol`), the OpenAI chat and completions APIs (`openai_api`,
`completions_api`) and the request guards (`serve_guard`, `serve_requests`).
"""
