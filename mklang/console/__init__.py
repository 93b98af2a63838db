"""The web console of `mklang serve` (docs/console.md): stored runs, their traces and graphs, and an
inbox whose replies resume the runs that wait on a human.

It needs the `console` extra (starlette, uvicorn, jinja2); nothing else imports this package.
"""
