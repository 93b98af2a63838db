"""The language server: pygls wiring around `mklang.lsp.analysis.Document`.

Every open document is re-analysed on each change (parsing and checking a
machine takes milliseconds) and its diagnostics are published at once.
Positions cross the boundary here, and only here: the analysis counts code
points, the client counts in the negotiated encoding (UTF-16 by default).
"""

from __future__ import annotations

from typing import Protocol

from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer
from pygls.uris import from_fs_path
from pygls.workspace import ServerTextPosition, ServerTextRange, TextDocument

from mklang.lsp.analysis import Document, Pos, Range, span_range
from mklang.version import __version__

server = LanguageServer("mklang", __version__, text_document_sync_kind=lsp.TextDocumentSyncKind.Full)
documents: dict[str, Document] = {}

COMPLETION_KINDS = {
    "state": lsp.CompletionItemKind.Class,
    "keyword": lsp.CompletionItemKind.Keyword,
    "key": lsp.CompletionItemKind.Variable,
}
SEVERITIES = {"error": lsp.DiagnosticSeverity.Error, "warning": lsp.DiagnosticSeverity.Warning}


def to_client(doc: TextDocument, where: Range) -> lsp.Range:
    (sl, sc), (el, ec) = where
    return doc.range_to_client_units(
        ServerTextRange(start=ServerTextPosition(line=sl, character=sc), end=ServerTextPosition(line=el, character=ec))
    )


def from_client(doc: TextDocument, position: lsp.Position) -> Pos:
    server_position = doc.position_from_client_units(position)
    return server_position.line, server_position.character


def analyse(uri: str) -> None:
    """Re-analyse the document at `uri` and publish its diagnostics."""
    doc = server.workspace.get_text_document(uri)
    previous = documents.get(uri)
    analysis = Document(doc.source, doc.path, previous.model if previous else None)
    documents[uri] = analysis
    diagnostics = [
        lsp.Diagnostic(
            range=to_client(doc, span_range(d.line, d.col, d.end_line, d.end_col)),
            severity=SEVERITIES[d.severity],
            code=d.code,
            source="mklang",
            message=d.message,
        )
        for d in analysis.diagnostics
    ]
    server.text_document_publish_diagnostics(
        lsp.PublishDiagnosticsParams(uri=uri, diagnostics=diagnostics, version=doc.version)
    )


def current(uri: str) -> tuple[TextDocument, Document]:
    if uri not in documents:
        analyse(uri)
    return server.workspace.get_text_document(uri), documents[uri]


class PositionRequest(Protocol):
    """A request about one position of one document (definition, references, completion, hover)."""

    @property
    def text_document(self) -> lsp.TextDocumentIdentifier: ...
    @property
    def position(self) -> lsp.Position: ...


def at_cursor(params: PositionRequest) -> tuple[TextDocument, Document, Pos]:
    """The document a request is about, its analysis, and the request's position in mklang terms."""
    doc, analysis = current(params.text_document.uri)
    return doc, analysis, from_client(doc, params.position)


@server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
def did_open(params: lsp.DidOpenTextDocumentParams) -> None:
    analyse(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
def did_change(params: lsp.DidChangeTextDocumentParams) -> None:
    analyse(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(params: lsp.DidCloseTextDocumentParams) -> None:
    documents.pop(params.text_document.uri, None)
    server.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=params.text_document.uri, diagnostics=[]))


@server.feature(lsp.TEXT_DOCUMENT_DEFINITION)
def definition(params: lsp.DefinitionParams) -> lsp.Location | None:
    doc, analysis, position = at_cursor(params)
    found = analysis.definition(position)
    if found is None:
        return None
    path, where = found
    if path is None:
        return lsp.Location(uri=doc.uri, range=to_client(doc, where))
    start = lsp.Position(line=0, character=0)
    return lsp.Location(uri=from_fs_path(path) or path, range=lsp.Range(start=start, end=start))


@server.feature(lsp.TEXT_DOCUMENT_REFERENCES)
def references(params: lsp.ReferenceParams) -> list[lsp.Location]:
    doc, analysis, position = at_cursor(params)
    found = analysis.references(position, params.context.include_declaration)
    return [lsp.Location(uri=doc.uri, range=to_client(doc, where)) for where in found]


@server.feature(lsp.TEXT_DOCUMENT_COMPLETION, lsp.CompletionOptions(trigger_characters=[">", "{", " "]))
def completion(params: lsp.CompletionParams) -> lsp.CompletionList:
    _, analysis, position = at_cursor(params)
    items = [
        lsp.CompletionItem(label=c.label, kind=COMPLETION_KINDS[c.kind], detail=c.detail or None)
        for c in analysis.completions(position)
    ]
    return lsp.CompletionList(is_incomplete=False, items=items)


@server.feature(lsp.TEXT_DOCUMENT_HOVER)
def hover(params: lsp.HoverParams) -> lsp.Hover | None:
    doc, analysis, position = at_cursor(params)
    match analysis.hover(position):
        case (text, where):
            markdown = lsp.MarkupContent(kind=lsp.MarkupKind.Markdown, value=text)
            return lsp.Hover(contents=markdown, range=to_client(doc, where))
    return None


@server.feature(lsp.TEXT_DOCUMENT_FORMATTING)
def formatting(params: lsp.DocumentFormattingParams) -> list[lsp.TextEdit] | None:
    doc, analysis = current(params.text_document.uri)
    text = analysis.formatted()
    if text is None or text == analysis.text:
        return None if text is None else []
    return [lsp.TextEdit(range=to_client(doc, ((0, 0), analysis.end())), new_text=text)]


@server.feature(lsp.TEXT_DOCUMENT_DOCUMENT_SYMBOL)
def symbols(params: lsp.DocumentSymbolParams) -> list[lsp.DocumentSymbol]:
    doc, analysis = current(params.text_document.uri)
    return [
        lsp.DocumentSymbol(
            name=name,
            detail=detail or None,
            kind=lsp.SymbolKind.Class,
            range=to_client(doc, whole),
            selection_range=to_client(doc, selection),
        )
        for name, detail, whole, selection in analysis.outline()
    ]


def serve() -> None:
    """Speak LSP on stdin/stdout until the client exits."""
    server.start_io()
