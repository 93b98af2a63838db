"""MCP both ways (docs/mcp.md, ADR 0047): `servers` and `client` give machines the tools of MCP
servers (host layer); `server` and `tools` serve machines to MCP clients (`mklang mcp`, tools layer).
The `mcp` SDK is the `mcp` extra, imported only where a connection is made."""
