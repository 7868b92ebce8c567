"""A TraceQL syntax checker that accepts and rejects what Grafana Tempo's parser does.

``parse(query)`` returns None when Tempo's ``traceql.Parse`` would accept the query and
raises ``TraceQLError`` (a ValueError) with what went wrong and the character offset
otherwise. It is written from Tempo v2.8.2's sources (the tag, commit 6b92615861c3):

* ``pkg/traceql/lexer.go``: Go's ``text/scanner`` in its default mode (Go-style idents,
  ints, floats, "strings", `raw strings`, 'chars'; // and /* */ comments skipped), the
  longest-match of operator and scope tokens (``span.``, ``parent.``, ``span:``, ``!>>``),
  the attribute sub-lexer after ``.``/``span.``/``resource.``/... (names run to the next
  space or one of ``{}()=~!<>&|^,``, may have "quoted" parts with only ``\\"`` and ``\\\\``
  escapes, and end with an END_ATTRIBUTE token), the ``parent.span.``/``parent.resource.``
  scope rule, and numbers followed by a duration (Prometheus' ``model.ParseDuration``,
  then Go's ``time.ParseDuration``: ``5ms``, ``1.5s``, ``1h30m``, ``2d``).
* The lexer's string handling: a "double-quoted" string must pass text/scanner's escape
  check and Go's ``strconv.Unquote``, so only ``\\a \\b \\f \\n \\r \\t \\v \\\\ \\"``, octal,
  ``\\x``, ``\\u`` and ``\\U`` escapes exist: ``"Qwen\\/Qwen2\\.5"`` is rejected ("invalid char
  escape"), ``"a\\\\.b"`` is fine. Backtick raw strings take backslashes literally:
  ``=~ `Qwen\\/Qwen2\\.5``` is accepted.
* ``pkg/traceql/expr.y``: the grammar, re-stated below with its precedence table; an
  LALR(1) automaton is built from it the way goyacc does (shift/reduce conflicts settled by
  precedence and associativity, the remaining one by shifting, reduce/reduce by the
  earlier rule). That reproduces yacc-specific rejections too, for example
  ``({ .a }) && ({ .b } | count() > 1)`` fails while the mirrored query parses.

Not checked, deliberately: the semantic pass Tempo runs after parsing
(``ast_validate.go``: ``{ 1 = "a" }`` or ``{ .a }`` not being boolean, invalid regexes,
unsupported features such as ``parent``), query limits and hints' meanings; Grafana
template variables (render them first). Minor approximations: error messages and
offsets are this module's own; range limits of huge numbers are approximate.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from typing import NamedTuple

__all__ = ["TraceQLError", "parse"]


class TraceQLError(ValueError):
    """Tempo would reject the query; the message says what and at which offset."""


# --- Lexer (pkg/traceql/lexer.go on top of Go's text/scanner)

# The Tempo release this grammar is written from: the compose file's default
# TEMPO_VERSION must be this one (tests/deploy/test_traceql_grammar.py).
TEMPO_VERSION = "2.8.2"

_TOKEN_TEXT = (
    ", . { } ( ) = != =~ !~ > >= < <= + - / % * ^ && || ! | >> << ~ !> !< !>> !<< &~ &> &< "
    "&>> &<< true false nil ok error unset unspecified internal server client producer "
    "consumer duration childCount name status statusMessage kind rootName rootServiceName "
    "rootService traceDuration nestedSetLeft nestedSetRight nestedSetParent id traceID "
    "spanID parentID timeSinceStart version parent parent. resource. span. trace: span: "
    "event: link: instrumentation: event. link. instrumentation. count avg max min sum by "
    "coalesce select rate count_over_time min_over_time max_over_time avg_over_time "
    "sum_over_time quantile_over_time histogram_over_time compare topk bottomk with"
)
_TOKENS = frozenset(_TOKEN_TEXT.split())
_SCOPES = frozenset(t for t in _TOKENS if len(t) > 2 and t[-1] in ".:")
_ATTRIBUTE_STARTERS = frozenset(t for t in _SCOPES if t.endswith(".")) | {"."}
_NOT_ATTRIBUTE = frozenset("{}()=~!<>&|^,")
_SIMPLE_ESCAPES = frozenset("abfnrtv\\")
_GO_UNITS = {"ns": 1, "us": 10**3, "\u00b5s": 10**3, "\u03bcs": 10**3, "ms": 10**6}
_GO_UNITS |= {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_PROM_UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PROM_UNITS_MS = {u: (i, s * 1000) for i, (u, s) in enumerate(_PROM_UNITS.items())}
_PROM_UNITS_MS["ms"] = (len(_PROM_UNITS), 1)
_MAX_NS = 2**63 - 1
_PREFIX = re.compile(r"0([xXoObB])?")
_MANTISSA = {  # for hexadecimal numbers or not: integer part, fraction
    True: re.compile(r"(?:0[xX])?([0-9a-fA-F_]*)(\.[0-9a-fA-F_]*)?"),
    False: re.compile(r"(?:0[oObB]?)?([0-9_]*)(\.[0-9_]*)?"),
}
_EXPONENT = re.compile(r"([eEpP])[+-]?[0-9_]*")
_BAD_SEP = {  # for hexadecimal numbers or not: '_' must sit between digits
    True: re.compile(r"(?<![0-9a-fA-FxX])_|_(?![0-9a-fA-F])"),
    False: re.compile(r"(?<![0-9oObB])_|_(?![0-9])"),
}


class Token(NamedTuple):
    kind: str  # a spelling from _TOKENS, or IDENTIFIER STRING INTEGER FLOAT DURATION ...
    offset: int


def _go_space(c: str) -> bool:  # unicode.IsSpace
    return c in "\t\n\v\f\r \x85\xa0" or (c > "\xff" and c.isspace())


def _attribute_rune(c: str) -> bool:  # isAttributeRune; "" is EOF
    return c != "" and not _go_space(c) and c not in _NOT_ATTRIBUTE


def _prom_duration(s: str) -> bool:  # prometheus/common model.ParseDuration
    if s == "0":
        return True
    last, total = -1, 0
    while s:
        m = re.match(r"([0-9]+)([^0-9]*)", s)
        if not m or m.group(2) not in _PROM_UNITS_MS:
            return False
        pos, mult = _PROM_UNITS_MS[m.group(2)]
        if pos <= last:  # units must go from biggest to smallest
            return False
        last, total, s = pos, total + int(m.group(1)) * mult * 10**6, s[m.end() :]
    return total <= _MAX_NS


def _go_duration(s: str) -> bool:  # Go's time.ParseDuration (no sign: the text is a number)
    if s == "0":
        return True
    total = 0.0
    while s:
        m = re.match(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)", s)
        if not m or not (m.group(1) or m.group(2)) or m.group(3) not in _GO_UNITS:
            return False
        value = float(f"{m.group(1) or 0}.{m.group(2) or 0}")
        total, s = total + value * _GO_UNITS[m.group(3)], s[m.end() :]
    return total <= 2**63


class _Lexer:
    def __init__(self, src: str) -> None:
        self.src, self.pos = src, int(src.startswith("\ufeff"))  # the scanner skips a BOM
        if "\x00" in src:  # text/scanner reports NUL wherever it reads one
            raise self.fail("invalid character NUL", src.index("\x00"))
        self.in_attribute = False  # lexer.parsingAttribute
        self.scope = ""  # lexer.currentScope

    def peek(self, ahead: int = 0) -> str:
        return self.src[self.pos + ahead : self.pos + ahead + 1]

    def fail(self, what: str, offset: int | None = None) -> TraceQLError:
        at = self.pos if offset is None else offset
        return TraceQLError(f"{what} at offset {at} in: {self.src}")

    def next_token(self) -> Token:
        if self.in_attribute:
            if not _attribute_rune(self.peek()):
                self.in_attribute = False
                return Token("END_ATTRIBUTE", self.pos)
            return self._attribute()
        kind, start = self._scan()
        text = self.src[start : self.pos]
        if kind in ("INTEGER", "FLOAT"):
            return Token(self._number(kind, text, start), start)
        if kind != "TEXT":
            return Token(kind, start)
        while self.peek() and text + self.peek() in _TOKENS:  # longest operator/scope
            text += self.peek()
            self.pos += 1
        if text in _SCOPES:
            self.scope = text
        if text in _TOKENS:
            self.in_attribute = text in _ATTRIBUTE_STARTERS
            return Token(text, start)
        return Token("IDENTIFIER", start)

    def _scan(self) -> tuple[str, int]:
        """One text/scanner Scan(): skips blanks and comments, returns (kind, start)."""
        src = self.src
        while True:
            while self.peek() in (" ", "\t", "\n", "\r"):
                self.pos += 1
            if self.peek() != "/" or self.peek(1) not in ("/", "*"):
                break
            if self.peek(1) == "/":
                end = src.find("\n", self.pos)
                self.pos = len(src) if end < 0 else end
            elif (end := src.find("*/", self.pos + 2)) < 0:
                raise self.fail("comment not terminated")
            else:
                self.pos = end + 2
        start, c = self.pos, self.peek()
        if c == "":
            return "$end", start
        if c == "_" or c.isalpha():
            while self.peek() == "_" or self.peek().isalpha() or self.peek().isdecimal():
                self.pos += 1
            return "TEXT", start
        if c in "0123456789" or (c == "." and self.peek(1) in tuple("0123456789")):
            return self._scan_number(), start
        if c in "\"'":
            chars = self._quoted(c)
            if c == "'" and chars != 1:
                raise self.fail("invalid char literal", start)
            return ("STRING" if c == '"' else "IDENTIFIER"), start  # a 'c' is an identifier
        if c == "`":
            end = src.find("`", start + 1)
            if end < 0:
                raise self.fail("literal not terminated", start)
            self.pos = end + 1
            return "STRING", start
        self.pos += 1
        return "TEXT", start

    def _scan_number(self) -> str:
        """text/scanner's scanNumber: a Go number literal, with the scanner's error checks."""
        start = self.pos
        prefix = _PREFIX.match(self.src, start)
        radix = (prefix.group(1) or "0").lower() if prefix else ""  # "", "0", "x", "o", "b"
        m = _MANTISSA[radix == "x"].match(self.src, start)
        assert m is not None  # every part is optional
        exponent = _EXPONENT.match(self.src, m.end())
        letter = exponent.group(1).lower() if exponent else ""
        self.pos = (exponent or m).end()
        text, mantissa = self.src[start : self.pos], m.group(1) + (m.group(2) or "")
        hex_digits = radix == "x" and re.search("[0-9a-fA-F]", mantissa)
        problems = {
            "invalid radix point": m.group(2) is not None and radix in ("o", "b"),
            "no digits": not (radix == "0" or hex_digits or re.search("[0-9]", mantissa)),
            "exponent does not fit the mantissa": (letter == "p" and radix != "x")
            or (letter == "e" and radix not in ("", "0")),
            "exponent has no digits": exponent is not None
            and not re.search("[0-9]", exponent.group(0)),
            "hexadecimal mantissa requires a 'p' exponent": radix == "x"
            and m.group(2) is not None
            and exponent is None,
            "invalid digit": m.group(2) is None
            and exponent is None
            and re.search({"0": "[89]", "o": "[89]", "b": "[2-9]"}.get(radix, "$^"), mantissa),
            "'_' must separate successive digits": _BAD_SEP[radix == "x"].search(text),
        }
        for problem, found in problems.items():
            if found:
                raise self.fail(f"{problem} in number {text!r}", start)
        return "INTEGER" if m.group(2) is None and exponent is None else "FLOAT"

    def _number(self, kind: str, text: str, start: int) -> str:
        """The lexer's number handling: a duration if one follows, else Atoi/ParseFloat."""
        end = self.pos
        while (c := self.src[end : end + 1]) and not _go_space(c):
            if not (unicodedata.category(c)[0] == "N" or c in "nsumh\u00b5dwy."):
                break
            end += 1
        candidate = self.src[start:end]
        if end > self.pos and (_prom_duration(candidate) or _go_duration(candidate)):
            self.pos = end
            return "DURATION"
        if kind == "INTEGER":
            if not text.isdigit() or not text.isascii() or int(text) > _MAX_NS:
                raise self.fail(f"strconv.Atoi: parsing {text!r}: invalid syntax", start)
            return kind
        clean = text.replace("_", "")
        value = float.fromhex(clean) if clean[:2].lower() == "0x" else float(clean)
        if value in (float("inf"), float("-inf")):
            raise self.fail(f"strconv.ParseFloat: parsing {text!r}: value out of range", start)
        return kind

    def _quoted(self, quote: str) -> int:
        """Scans a "string" or 'char' with Go's escape rules; returns its character count."""
        src, i, count = self.src, self.pos + 1, 0
        while True:
            if i >= len(src) or src[i] == "\n":
                raise self.fail("literal not terminated", self.pos)
            if src[i] == quote:
                self.pos = i + 1
                return count
            i = self._escape(i + 1) if src[i] == "\\" else i + 1
            count += 1

    def _escape(self, i: int) -> int:
        c, quote = self.src[i : i + 1], self.src[self.pos]
        if c and (c in _SIMPLE_ESCAPES or c == quote):
            return i + 1
        if c and c in "01234567":  # three octal digits, at most \377
            start, width, allowed, limit = i, 3, "01234567", 0o377
        else:  # \xFF, \uFFFF, \UFFFFFFFF: a valid code point
            width = {"x": 2, "u": 4, "U": 8}.get(c, 0)
            start, allowed, limit = i + 1, "0123456789abcdefABCDEF", 0x10FFFF
        digits = self.src[start : start + width]
        valid = width and len(digits) == width and all(d in allowed for d in digits)
        value = int(digits, 16 if width != 3 else 8) if valid else -1
        if not 0 <= value <= limit or (c in ("u", "U") and 0xD800 <= value <= 0xDFFF):
            where = "a double-quoted string" if quote == '"' else "a 'char'"
            raise self.fail(
                f"invalid char escape {self.src[i - 1 : i + 1]} in {where} (Go's strconv.Unquote;"
                " a `raw string` keeps backslashes)",
                i - 1,
            )
        return start + width

    def _attribute(self) -> Token:
        """The attribute sub-lexer: an optional parent scope, then the name (IDENTIFIER)."""
        start, rest = self.pos, self.src[self.pos :]
        if self.scope == "parent." and rest.startswith(("span.", "resource.")):
            self.scope = "span." if rest.startswith("span.") else "resource."
            self.pos += len(self.scope)
            return Token(self.scope, start)
        while (c := self.peek()) == '"' or _attribute_rune(c):
            if c != '"':
                self.pos += 1
                continue
            self.pos += 1
            while (c := self.peek()) != '"':
                if c == "":
                    raise self.fail('unexpected EOF, expecting "', start)
                if c == "\\" and self.peek(1) not in ('"', "\\"):
                    raise self.fail("invalid escape sequence in attribute name")
                self.pos += 2 if c == "\\" else 1
            self.pos += 1
        return Token("IDENTIFIER", start)


# --- Grammar (pkg/traceql/expr.y): 'x' is the token spelled x, UPPER a token class, and
# @M a macro standing for each of its alternatives in turn.

_MACROS = {
    "SPANSET_OP": "'&&' | '>' | '<' | '>>' | '<<' | '||' | '~' | '!>' | '!<' | '!>>' | '!<<' "
    "| '!~' | '&>' | '&<' | '&>>' | '&<<' | '&~'",
    "ARITH": "'+' | '-' | '*' | '/' | '%' | '^'",
    "FIELD_OP": "'+' | '-' | '*' | '/' | '%' | '=' | '!=' | '<' | '<=' | '>' | '>=' | '=~' "
    "| '!~' | '^' | '&&' | '||'",
    "CMP": "'=' | '!=' | '<' | '<=' | '>' | '>='",
    "BY": " | 'by' '(' attribute_list ')'",
    "OVER_TIME": "'min_over_time' | 'max_over_time' | 'sum_over_time' | 'avg_over_time' "
    "| 'histogram_over_time'",
    "AGGREGATE": "'max' | 'min' | 'avg' | 'sum'",
    "SCOPE": "'.' | 'resource.' | 'span.' | 'parent.' | 'parent.' 'resource.' "
    "| 'parent.' 'span.' | 'event.' | 'link.' | 'instrumentation.'",
}

_GRAMMAR = """
root: spanset_pipeline | pipeline_expression | scalar_pipeline_filter
    | spanset_pipeline '|' metrics | spanset_pipeline '|' metrics '|' second_stage
    | root hints
pipeline_expression: '(' pipeline_expression ')'
    | pipeline_expression @SPANSET_OP pipeline_expression | wrapped_pipeline
wrapped_pipeline: '(' spanset_pipeline ')'
spanset_pipeline: spanset_expression | scalar_filter | group_operation | select_operation
    | spanset_pipeline '|' spanset_expression | spanset_pipeline '|' scalar_filter
    | spanset_pipeline '|' group_operation | spanset_pipeline '|' coalesce_operation
    | spanset_pipeline '|' select_operation
group_operation: 'by' '(' field ')'
coalesce_operation: 'coalesce' '(' ')'
select_operation: 'select' '(' attribute_list ')'
attribute: intrinsic | attribute_field | scoped_intrinsic
attribute_list: attribute | attribute_list ',' attribute
numbers: FLOAT | INTEGER | numbers ',' FLOAT | numbers ',' INTEGER
spanset_expression: '(' spanset_expression ')'
    | spanset_expression @SPANSET_OP spanset_expression | spanset_filter
spanset_filter: '{' '}' | '{' field '}'
scalar_filter: scalar_expression comparison scalar_expression
comparison: @CMP
scalar_pipeline_filter: scalar_pipeline_expression comparison scalar_pipeline_expression
    | scalar_pipeline_expression comparison static
scalar_pipeline_expression: '(' scalar_pipeline_expression ')'
    | scalar_pipeline_expression @ARITH scalar_pipeline_expression | wrapped_scalar_pipeline
wrapped_scalar_pipeline: '(' scalar_pipeline ')'
scalar_pipeline: spanset_pipeline '|' aggregate
scalar_expression: '(' scalar_expression ')' | scalar_expression @ARITH scalar_expression
    | aggregate | INTEGER | FLOAT | DURATION | '-' INTEGER | '-' FLOAT | '-' DURATION
aggregate: 'count' '(' ')' | @AGGREGATE '(' field ')'
metrics: 'rate' '(' ')' @BY | 'count_over_time' '(' ')' @BY
    | @OVER_TIME '(' attribute ')' @BY
    | 'quantile_over_time' '(' attribute ',' numbers ')' @BY
    | 'compare' '(' spanset_filter ')' | 'compare' '(' spanset_filter ',' INTEGER ')'
    | 'compare' '(' spanset_filter ',' INTEGER ',' INTEGER ',' INTEGER ')'
second_stage: 'topk' '(' INTEGER ')' | 'bottomk' '(' INTEGER ')'
hints: 'with' '(' hint_list ')'
hint_list: hint | hint_list ',' hint
hint: IDENTIFIER '=' static
field: '(' field ')' | field @FIELD_OP field
    | field '!=' 'nil' | 'nil' '!=' field | 'nil' '!=' 'nil' | 'nil' '=' 'nil'
    | '-' field | '!' field | static | intrinsic | attribute_field | scoped_intrinsic
static: STRING | INTEGER | FLOAT | 'true' | 'false' | DURATION | 'ok' | 'error' | 'unset'
    | 'unspecified' | 'internal' | 'server' | 'client' | 'producer' | 'consumer'
intrinsic: 'duration' | 'childCount' | 'name' | 'status' | 'statusMessage' | 'kind' | 'parent'
    | 'rootName' | 'rootServiceName' | 'traceDuration' | 'nestedSetLeft' | 'nestedSetRight'
    | 'nestedSetParent'
scoped_intrinsic: 'trace:' 'duration' | 'trace:' 'rootName' | 'trace:' 'rootService'
    | 'trace:' 'id' | 'span:' 'duration' | 'span:' 'name' | 'span:' 'kind' | 'span:' 'status'
    | 'span:' 'statusMessage' | 'span:' 'id' | 'span:' 'parentID' | 'event:' 'name'
    | 'event:' 'timeSinceStart' | 'link:' 'traceID' | 'link:' 'spanID'
    | 'instrumentation:' 'name' | 'instrumentation:' 'version'
attribute_field: @SCOPE IDENTIFIER END_ATTRIBUTE
"""

# Increasing precedence, as declared in expr.y.
_PRECEDENCE = [
    ("left", "|"),
    ("left", "&& ||"),
    ("left", "= != < <= > >= !~ =~ >> << ~ !> !< !>> !<< &> &< &>> &<< &~"),
    ("left", "+ -"),
    ("left", "!"),
    ("left", "* / %"),
    ("right", "^"),
    ("nonassoc", "nil"),
]
_CLASS_TEXT = "IDENTIFIER STRING INTEGER FLOAT DURATION END_ATTRIBUTE $end"
_CLASSES = frozenset(_CLASS_TEXT.split())

Rule = tuple[str, tuple[str, ...]]


def _alternatives(body: str) -> list[str]:
    return re.split(r"\s\|\s", f" {body} ")


def _symbols(alternative: str) -> list[tuple[str, ...]]:
    """Every expansion of one alternative, macros substituted (as grammar symbols)."""
    choices: list[list[tuple[str, ...]]] = []
    for word in alternative.split():
        if word.startswith("@"):
            choices.append([s for alt in _alternatives(_MACROS[word[1:]]) for s in _symbols(alt)])
        else:
            choices.append([(word.strip("'"),)])
    return [tuple(itertools.chain.from_iterable(p)) for p in itertools.product(*choices)]


def _rules() -> list[Rule]:
    rules: list[Rule] = [("$accept", ("root",))]
    for block in re.split(r"\n(?=\w)", _GRAMMAR.strip()):
        lhs, body = block.split(":", 1)
        for alternative in _alternatives(body):
            rules.extend((lhs.strip(), rhs) for rhs in _symbols(alternative))
    assert not {lhs for lhs, _ in rules} & _TOKENS, "a nonterminal named like a token"
    known = {lhs for lhs, _ in rules} | _TOKENS | _CLASSES
    unknown = {s for _, rhs in rules for s in rhs} - known
    assert not unknown, f"unknown grammar symbols {unknown}"
    return rules


# --- LALR(1) tables, built the way goyacc builds them

Item = tuple[int, int]  # (rule index, dot position)


class _Tables(NamedTuple):
    rules: list[Rule]
    actions: list[dict[str, int]]  # state -> token -> shift target (>= 0) or ~rule
    gotos: list[dict[str, int]]  # state -> nonterminal -> state
    unresolved: list[tuple[int, str]]  # (state, token) conflicts settled by default


class _Automaton:
    """The LR(0) states of the grammar and their LALR(1) lookaheads."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self.by_lhs: dict[str, list[int]] = {}
        for index, (lhs, rhs) in enumerate(rules):
            assert rhs, f"empty rule for {lhs}: the construction assumes none"
            self.by_lhs.setdefault(lhs, []).append(index)
        self.first: dict[str, set[str]] = {nt: set() for nt in self.by_lhs}
        changed = True
        while changed:
            changed = False
            for lhs, rhs in rules:
                new = self.first.get(rhs[0], {rhs[0]})
                if not new <= self.first[lhs]:
                    self.first[lhs] |= new
                    changed = True
        self.kernels: list[dict[Item, set[str]]] = [{(0, 0): {"$end"}}]
        self.moves: list[dict[str, int]] = []
        index_of: dict[frozenset[Item], int] = {frozenset(self.kernels[0]): 0}
        state = 0
        while state < len(self.kernels):  # LR(0) states, breadth first
            targets: dict[str, set[Item]] = {}
            for rule, dot in self.closure(state):
                rhs = rules[rule][1]
                if dot < len(rhs):
                    targets.setdefault(rhs[dot], set()).add((rule, dot + 1))
            self.moves.append({})
            for symbol, kernel in targets.items():
                key = frozenset(kernel)
                if key not in index_of:
                    index_of[key] = len(self.kernels)
                    self.kernels.append({item: set() for item in kernel})
                self.moves[state][symbol] = index_of[key]
            state += 1
        self._propagate()

    def closure(self, state: int) -> dict[Item, set[str]]:
        """All items of a state with their lookaheads, from its kernel's lookaheads."""
        items = {item: set(la) for item, la in self.kernels[state].items()}
        work = list(items)
        while work:
            rule, dot = work.pop()
            rhs = self.rules[rule][1]
            if dot >= len(rhs) or rhs[dot] not in self.by_lhs:
                continue
            follow = rhs[dot + 1] if dot + 1 < len(rhs) else None
            new = items[(rule, dot)] if follow is None else self.first.get(follow, {follow})
            for produced in self.by_lhs[rhs[dot]]:
                item = (produced, 0)
                if item not in items or not new <= items[item]:
                    items.setdefault(item, set()).update(new)
                    work.append(item)
        return items

    def _propagate(self) -> None:
        pending = set(range(len(self.kernels)))
        while pending:
            state = pending.pop()
            for (rule, dot), la in self.closure(state).items():
                rhs = self.rules[rule][1]
                if dot < len(rhs):
                    target = self.moves[state][rhs[dot]]
                    kernel_la = self.kernels[target][(rule, dot + 1)]
                    if not la <= kernel_la:
                        kernel_la |= la
                        pending.add(target)


def _rule_precedence(rhs: tuple[str, ...], levels: dict[str, tuple[int, str]]) -> int:
    """goyacc: a rule takes the precedence of its last token (0 if that token has none)."""
    tokens = [s for s in rhs if s in _TOKENS or s in _CLASSES]
    return levels[tokens[-1]][0] if tokens and tokens[-1] in levels else 0


@functools.cache
def _tables() -> _Tables:
    rules = _rules()
    machine = _Automaton(rules)
    levels = {t: (i + 1, assoc) for i, (assoc, ts) in enumerate(_PRECEDENCE) for t in ts.split()}
    actions: list[dict[str, int]] = []
    unresolved: list[tuple[int, str]] = []
    for state, moves in enumerate(machine.moves):
        act = {s: target for s, target in moves.items() if s not in machine.by_lhs}
        for (rule, dot), lookahead in sorted(machine.closure(state).items()):
            if dot < len(rules[rule][1]):
                continue
            for token in sorted(lookahead):
                if token not in act:
                    act[token] = ~rule
                elif act[token] < 0:  # reduce/reduce: the earlier rule wins
                    unresolved.append((state, token))
                else:
                    level, assoc = levels.get(token, (0, ""))
                    rule_level = _rule_precedence(rules[rule][1], levels)
                    if not level or not rule_level:
                        unresolved.append((state, token))  # shift, as yacc does
                    elif rule_level > level or (rule_level == level and assoc == "left"):
                        act[token] = ~rule
                    elif rule_level == level and assoc == "nonassoc":
                        del act[token]
        actions.append(act)
    gotos = [{s: t for s, t in moves.items() if s in machine.by_lhs} for moves in machine.moves]
    return _Tables(rules, actions, gotos, unresolved)


def _syntax_error(query: str, token: Token, expected: list[str]) -> TraceQLError:
    shown = [t if t in _CLASSES else repr(t) for t in (token.kind, *expected)]
    hint = ", ".join(sorted(shown[1:], key=str.lower)[:12]) + ", ..." * (len(shown) > 13)
    return TraceQLError(
        f"syntax error at offset {token.offset}: unexpected {shown[0]}, expecting {hint}"
        f" in: {query}"
    )


def parse(query: str) -> None:
    """Raise TraceQLError unless Tempo v2.8's traceql.Parse accepts the query."""
    tables = _tables()
    lexer = _Lexer(query)
    stack = [0]
    token = lexer.next_token()
    while True:
        action = tables.actions[stack[-1]].get(token.kind)
        if action is None:
            raise _syntax_error(query, token, list(tables.actions[stack[-1]]))
        if action >= 0:
            stack.append(action)
            token = lexer.next_token()
            continue
        lhs, rhs = tables.rules[~action]
        if lhs == "$accept":
            return
        del stack[len(stack) - len(rhs) :]
        stack.append(tables.gotos[stack[-1]][lhs])
