"""Serving: chat-template rendering, output parsing (reasoning + tool calls), and the HTTP server."""
