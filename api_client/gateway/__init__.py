"""The HTTP gateway (`ggufq serve`): Ollama's API at /api, OpenAI's at /v1, on the cluster."""

from api_client.gateway.app import make_app

__all__ = ["make_app"]
