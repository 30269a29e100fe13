"""moeserve's OpenAI-compatible HTTP server: ``moeserve serve`` (see ``moeserve.server.cli``)."""
