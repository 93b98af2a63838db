"""Pins for the model providers: the HTTP client, the OpenAI, Anthropic and scripted providers, the judge and the factory.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""
