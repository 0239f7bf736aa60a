"""`moeserve serve`: an OpenAI-compatible HTTP server over continuous batching (needs `pip install moeserve[serve]`).

app.py (endpoints) -> batcher.py (the engine thread) -> engine/batching.py (the batch itself); protocol.py
(request bodies, errors), responses.py (response objects), chat_template.py, chat_output.py (an answer split into
reasoning, content and tool calls: reasoning.py, tool_calls.py, tool_formats/ one module per tool-call format),
metrics.py, server.py (start-up), process.py (a server in a child process). Importing this package imports no web framework.
"""
