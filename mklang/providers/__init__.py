"""Model providers: the protocol, the scripted provider, HTTP providers, replay."""

from mklang.providers.base import NONE, UNPARSEABLE, Produced, Provider, Usage, Verdict

__all__ = ["NONE", "UNPARSEABLE", "Produced", "Provider", "Usage", "Verdict"]
