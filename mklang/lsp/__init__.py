"""The mklang language server (`mklang lsp`, extra `mklang[lsp]`)."""
