"""Read the command line out of a launch script without running it.

A small evaluator for the subset of bash that training scripts use: scalar and array assignments
(``NAME=value``, ``NAME=( ... )``, ``NAME+=( ... )``, ``export``), ``$NAME``, ``${NAME}``,
``${NAME:-default}`` (nested too), ``${NAME[@]}``, ``${NAME[i]}``, ``NAME[i]=value``, ``unset``,
``$((arithmetic))`` (bash's: 64-bit, division truncating toward zero, octal ``010`` and ``16#ff``),
``$'...'``, quoting, heredocs (their body is data, not commands), line continuations and
``source FILE`` / ``. FILE`` (the file read in place, relative to the script's folder).
Commands are never run: ``if``/``for`` bodies are read in order as if every branch ran (later
assignments win), ``$(command)`` expands to nothing (recorded in ``unresolved``), and an ``exit``
outside any block or condition ends the reading, as it ends bash's.

What a script may build is bounded (``MAX_VALUE_CHARS`` per value, ``MAX_WORDS`` per array or
command), so that doubling an array 40 times is refused in milliseconds instead of filling memory.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from pathlib import Path

from pipeplan.launchers.megatron.shell_arith import ansi_c, ansi_c_end, based, eval_int, literal
from pipeplan.errors import BadInputError
from pipeplan.formats.reading import read_input_text
from pipeplan.launchers.megatron.shell_lex import array_closed, closing_brace, outside_quotes, statements

__all__ = ["ShellScript", "read_script", "split_words"]

_KEYWORDS = {"if", "then", "else", "elif", "fi", "for", "do", "done", "while", "until", "case", "esac",
             "function", "{", "}", "!", "[[", "]]", "time"}
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
#: Words that open or close a block: an ``exit`` inside one may not run, so only one outside ends the reading.
_OPENERS = {"if", "case", "for", "while", "until", "select", "{"}
_CLOSERS = {"fi", "esac", "done", "}"}
#: Longest value (characters) and most words of an array or a command the reader builds.
MAX_VALUE_CHARS = 1_000_000
MAX_WORDS = 100_000
_HEREDOC = re.compile(r"(?<!<)<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


@dataclass
class ShellScript:
    """What the script defines and runs."""

    path: str
    scalars: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, list[str]] = field(default_factory=dict)
    commands: list[tuple[int, list[str]]] = field(default_factory=list)
    """(line number, words) of every command, in order, expanded."""
    unresolved: list[str] = field(default_factory=list)
    """Expansions the reader could not evaluate (``$1``, ``$(...)``)."""


#: How deep ``source`` may nest (a file sourcing itself is refused sooner, by name).
MAX_SOURCE_DEPTH = 8


class _Reader:
    def __init__(self, path: str, text: str, variables: dict[str, str], script: ShellScript | None = None,
                 sourced: tuple[str, ...] = ()):
        self.path = path
        self.text = text
        self.script = script if script is not None else ShellScript(path)
        self.script.scalars.update(variables)
        self.sourced = sourced + (str(Path(path).resolve()),)
        self.pos = 0
        self.line = 1

    def error(self, message: str):
        raise BadInputError(f"{self.path}: line {self.line}: {message}")

    def set_scalar(self, name: str, value: str) -> None:
        if len(value) > MAX_VALUE_CHARS:
            self.error(f"{name} grows to {len(value):,} characters; doctor reads values of at most "
                       f"{MAX_VALUE_CHARS:,}")
        self.script.scalars[name] = value
        self.script.arrays.pop(name, None)

    def set_array(self, name: str, elements: list[str]) -> None:
        if len(elements) > MAX_WORDS or sum(map(len, elements)) > MAX_VALUE_CHARS:
            self.error(f"array {name} grows to {len(elements):,} elements; doctor reads arrays of at most "
                       f"{MAX_WORDS:,} elements and {MAX_VALUE_CHARS:,} characters")
        self.script.arrays[name] = elements
        self.script.scalars.pop(name, None)

    # ---------------------------------------------------------------- expansion
    def lookup(self, name: str) -> list[str] | str | None:
        if name in self.script.arrays:
            return self.script.arrays[name]
        return self.script.scalars.get(name)

    def scalar(self, name: str) -> str:
        value = self.lookup(name)
        if value is None:
            if not (name.isdigit() or name in ("@", "*", "#", "?", "$", "!")):
                self.script.unresolved.append(f"${name}")
            else:
                self.script.unresolved.append(f"${name}")
            return ""
        return value[0] if isinstance(value, list) else value

    def arith(self, expr: str) -> str:
        shown = expr.strip()
        try:
            expr = re.sub(r"\b(\d+)#([0-9A-Za-z@_]+)", lambda m: str(based(m.group(1), m.group(2))), expr)
            expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self.scalar(m.group(1)) or "0", expr)
            expr = re.sub(r"\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda m: self.scalar(m.group(1)) or "0", expr)
            expr = re.sub(r"\b0[xX][0-9A-Fa-f]+\b|\b0[0-9]+\b", lambda m: str(literal(m.group())), expr)
            if len(expr) > 10_000:
                raise ValueError("too long")
            return str(eval_int(ast.parse(expr.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError, MemoryError):
            self.error(f"cannot evaluate $(( {shown} ))")

    def expansion(self, text: str, i: int) -> tuple[list[str] | str, int]:
        """Expand the ``$...`` at ``text[i]``; returns (value, index after it). Lists are arrays."""
        if text.startswith("$((", i):
            end = text.find("))", i)
            if end < 0:
                self.error("unterminated $((")
            return self.arith(text[i + 3:end]), end + 2
        if text.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(text):
                if text[j] == "(":
                    depth += 1
                elif text[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= len(text):
                self.error("unterminated $(")
            self.script.unresolved.append(text[i:j + 1])
            return "", j + 1
        if text.startswith("${", i):
            end = closing_brace(text, i)
            if end < 0:
                self.error("unterminated ${")
            body = text[i + 2:end]
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[([^\]@*]+)\]", body)
            if m:
                value = self.lookup(m.group(1))
                index = int(self.arith(m.group(2)))
                items = value if isinstance(value, list) else ([value] if value is not None else [])
                return (items[index] if -len(items) <= index < len(items) else ""), end + 1
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+)\[[@*]\]", body)
            if m:
                value = self.lookup(m.group(1))
                return (list(value) if isinstance(value, list) else ([value] if value else [])), end + 1
            m = re.fullmatch(r"#([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]", body)
            if m:
                value = self.lookup(m.group(1))
                return str(len(value) if isinstance(value, list) else int(bool(value))), end + 1
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+)(:?[-=+])(.*)", body, re.S)
            if m:
                name, op, word = m.groups()
                value = self.lookup(name)
                value = value[0] if isinstance(value, list) else value
                empty = value is None or (op.startswith(":") and value == "")
                default = self.expand_string(word)
                if op.endswith("+"):
                    return ("" if empty else default), end + 1
                if empty:
                    if op.endswith("="):
                        self.script.scalars[name] = default
                    return default, end + 1
                return value, end + 1
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|\d+", body):
                return self.scalar(body), end + 1
            self.script.unresolved.append(text[i:end + 1])
            return "", end + 1
        m = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*|\d|[@*#?$!])").match(text, i)
        if m:
            name = m.group(1)
            if name in ("@", "*"):
                self.script.unresolved.append(f"${name}")
                return [], m.end()
            return self.scalar(name), m.end()
        return "$", i + 1

    def expand_string(self, text: str) -> str:
        """Expand a word as inside double quotes (no splitting)."""
        words = self.words(text, keep_empty=True, as_string=True)
        return " ".join(words)

    def words(self, text: str, keep_empty: bool = False, as_string: bool = False) -> list[str]:
        """Split ``text`` into words the way bash does: quotes, escapes, expansions, splitting."""
        out: list[str] = []
        current: list[str] = []
        started = False
        i, n = 0, len(text)

        def flush():
            nonlocal current, started
            if started:
                out.append("".join(current))
            current, started = [], False

        while i < n:
            c = text[i]
            if c in " \t\n" and not as_string:
                flush()
                i += 1
            elif c == "#" and not started and not as_string:
                break
            elif c == "\\":
                if i + 1 < n:
                    current.append(text[i + 1])
                started = True
                i += 2
            elif c == "'" and not as_string:
                end = text.find("'", i + 1)
                if end < 0:
                    self.error("unterminated single quote")
                current.append(text[i + 1:end])
                started = True
                i = end + 1
            elif c == '"' and not as_string:
                j = i + 1
                started = True
                while j < n and text[j] != '"':
                    if text[j] == "\\" and j + 1 < n and text[j + 1] in '"\\$`':
                        current.append(text[j + 1])
                        j += 2
                    elif text[j] == "$":
                        value, j = self.expansion(text, j)
                        if isinstance(value, list):
                            # "${A[@]}": one word per element
                            if value:
                                current.append(value[0])
                                for element in value[1:]:
                                    out.append("".join(current))
                                    current = [element]
                        else:
                            current.append(value)
                    else:
                        current.append(text[j])
                        j += 1
                if j >= n:
                    self.error("unterminated double quote")
                i = j + 1
            elif c == "$" and text.startswith("$'", i) and not as_string:
                end = ansi_c_end(text, i + 2)
                if end < 0:
                    self.error("unterminated $'")
                current.append(ansi_c(text[i + 2:end]))
                started = True
                i = end + 1
            elif c == "$":
                value, i = self.expansion(text, i)
                parts = value if isinstance(value, list) else [value]
                if as_string:
                    current.append(" ".join(parts))
                    started = True
                    continue
                # Unquoted: each part is split on whitespace.
                pieces = [w for part in parts for w in part.split()]
                if pieces:
                    current.append(pieces[0])
                    started = True
                    for piece in pieces[1:]:
                        flush()
                        current, started = [piece], True
                    if parts and parts[-1][-1:].isspace():
                        flush()
            else:
                current.append(c)
                started = True
                i += 1
        flush()
        return out if keep_empty else [w for w in out if w != "" or True]

    # ---------------------------------------------------------------- statements
    def logical_lines(self):
        """Lines with continuations joined; an array assignment spans until its ')'."""
        lines = self.text.splitlines()
        i = 0
        while i < len(lines):
            start = i + 1
            line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            if re.match(r"^\s*(export\s+|local\s+|declare\s+(-a\s+)?)?[A-Za-z_][A-Za-z0-9_]*\+?=\(", line):
                while not array_closed(line) and i + 1 < len(lines):
                    i += 1
                    line += "\n" + lines[i]
                if not array_closed(line):
                    self.line = start
                    self.error("array assignment '(' is never closed")
            yield start, line
            i += 1
            heredoc = _HEREDOC.search(outside_quotes(line))
            if heredoc:
                # The body is the command's input, not script: skip it to the delimiter line.
                word, strip_tabs = heredoc.group(2), "<<-" in heredoc.group(0)
                while i < len(lines) and (lines[i].lstrip("\t") if strip_tabs else lines[i]) != word:
                    i += 1
                i += 1

    def run(self) -> ShellScript:
        depth = 0  # blocks (if, for, while, case, { }) open around the statement
        for number, line in self.logical_lines():
            self.line = number
            for statement, conditional in statements(line):
                words = statement.split()
                # The first word opens or closes a block; a { or } anywhere (`name() {`) does too.
                for word in words[:1] + [w for w in words[1:] if w in ("{", "}")]:
                    depth += (word in _OPENERS) - (word in _CLOSERS)
                depth = max(depth, 0)
                if words[:1] == ["exit"] and depth == 0 and not conditional:
                    return self.script  # bash stops here: what follows never runs
                self.statement(statement)
        return self.script

    def statement(self, text: str):
        stripped = text.strip()
        # `if c; then X=1; fi`: what follows then/else/do/{ is a statement of its own.
        while True:
            m = re.match(r"^(then|else|do|\{|\}|fi|done|esac|!)(\s+|$)", stripped)
            if not m:
                break
            stripped = stripped[m.end():]
        if not stripped or stripped.startswith("#"):
            return
        if re.match(r"^unset(\s|$)", stripped):
            for name in self.words(stripped)[1:]:
                if not name.startswith("-"):
                    self.script.scalars.pop(name, None)
                    self.script.arrays.pop(name, None)
            return
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\[([^\]]*)\]=", stripped)
        if m:
            index = int(self.arith(m.group(2)))
            value, _ = self.one_word(stripped[m.end():])
            items = self.lookup(m.group(1))
            items = list(items) if isinstance(items, list) else ([items] if items is not None else [])
            if not 0 <= index <= MAX_WORDS:
                self.error(f"{m.group(1)}[{m.group(2)}]: index {index} is outside 0 to {MAX_WORDS:,}")
            # Bash arrays are sparse; here elements past the end are appended in order.
            if index < len(items):
                items[index] = value
            else:
                items.append(value)
            self.set_array(m.group(1), items)
            return
        m = re.match(r"^(?:export\s+|local\s+|declare\s+(?:-a\s+)?)?([A-Za-z_][A-Za-z0-9_]*)(\+?)=\((.*)\)\s*(#.*)?$",
                     stripped, re.S)
        if m:
            name, append, body = m.group(1), m.group(2), m.group(3)
            elements = []
            for row in body.split("\n"):
                elements += self.words(row)
            if append:
                base = self.lookup(name)
                base = list(base) if isinstance(base, list) else ([base] if base else [])
                elements = base + elements
            self.set_array(name, elements)
            return
        words_text = stripped
        for keyword in ("export ", "local ", "readonly ", "declare "):
            if words_text.startswith(keyword):
                words_text = words_text[len(keyword):].lstrip()
        first = words_text.split(None, 1)[0] if words_text.split() else ""
        if _ASSIGN.match(first) and "=" in first and not first.startswith("-"):
            # One or more assignments, maybe before a command (FOO=1 cmd).
            rest = words_text
            while True:
                m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=", rest)
                if not m:
                    break
                value_words, consumed = self.one_word(rest[m.end():])
                value = value_words
                if m.group(2):
                    value = self.script.scalars.get(m.group(1), "") + value
                self.set_scalar(m.group(1), value)
                rest = rest[m.end() + consumed:].lstrip()
                if not rest or rest.startswith("#"):
                    return
            stripped = rest
        words = self.words(stripped)
        while words and words[0] in _KEYWORDS:
            words = words[1:]
        if words[:1] in (["source"], ["."]) and len(words) >= 2:
            self.source(words[1])
            return
        if len(words) > MAX_WORDS:
            self.error(f"a command of {len(words):,} words; doctor reads commands of at most {MAX_WORDS:,}")
        if words:
            self.script.commands.append((self.line, words))

    def source(self, name: str) -> None:
        """``source FILE`` / ``. FILE``: read FILE's assignments and commands into this script
        (resolved relative to the script's folder, as a launch script beside its plan export is
        run from there; never executed). A file that is not there is recorded as unresolved."""
        target = Path(name) if Path(name).is_absolute() else Path(self.path).parent / name
        if str(target.resolve()) in self.sourced:
            self.error(f"source {name}: sources itself (through {' -> '.join(Path(p).name for p in self.sourced)})")
        if len(self.sourced) > MAX_SOURCE_DEPTH:
            self.error(f"source {name}: more than {MAX_SOURCE_DEPTH} nested source commands")
        if not target.is_file():
            self.script.unresolved.append(f"source {name}")
            return
        text = read_input_text(target, "shell script")
        reader = _Reader(str(target), text, {}, script=self.script, sourced=self.sourced)
        try:
            reader.run()
        except BadInputError as exc:
            raise BadInputError(str(exc) if str(exc).startswith(str(target)) else f"{target}: {exc}") from None

    def one_word(self, text: str) -> tuple[str, int]:
        """The first shell word of ``text`` (an assignment's value), expanded, and its length."""
        i, n, depth, quote = 0, len(text), 0, None
        while i < n:
            c = text[i]
            if quote:
                if c == "\\" and quote in ('"', "$'"):
                    i += 2
                    continue
                if c == quote[-1]:
                    quote = None
            elif c in "'\"":
                quote = "$'" if c == "'" and i and text[i - 1] == "$" else c
            elif c == "\\":
                i += 2
                continue
            elif c == "$" and text.startswith("$(", i):
                depth += 1
                i += 2
                continue
            elif c == ")" and depth:
                depth -= 1
            elif c == "{" and i and text[i - 1] == "$":
                depth += 1
            elif c == "}" and depth:
                depth -= 1
            elif c in " \t" and not depth:
                break
            i += 1
        if quote:
            self.error("unterminated quote")
        word = text[:i]
        return self.expand_string(_unquote(self, word)), i


def _protect(text: str) -> str:
    """Literal text, escaped for :meth:`_Reader.expand_string` (which reads ``\\`` and ``$``)."""
    return text.replace("\\", "\\\\").replace("$", "\\$")


def _unquote(reader: _Reader, word: str) -> str:
    """An assignment value with its quoting removed, as bash does, and ``$`` kept for expansion.

    Quotes inside quotes of the other kind are kept (``"it's"``, ``'say "hi"'``), and so are
    escaped ones (``"a \\"b\\""``); single-quoted and ``$'...'`` text is protected from expansion.
    """
    out, i, double = [], 0, False
    while i < len(word):
        c = word[i]
        if double:
            if c == '"':
                double = False
            elif c == "\\" and i + 1 < len(word):
                # Inside double quotes a backslash escapes only " \\ $ `; elsewhere it is literal.
                out.append(word[i:i + 2] if word[i + 1] in '"\\$`' else "\\\\")
                i += 2 if word[i + 1] in '"\\$`' else 1
                continue
            else:
                out.append(c)
        elif c == "'" or word.startswith("$'", i):
            ansi = c == "$"
            start = i + 2 if ansi else i + 1
            end = ansi_c_end(word, start) if ansi else word.find("'", start)
            if end < 0:
                reader.error("unterminated single quote")
            body = word[start:end]
            out.append(_protect(ansi_c(body) if ansi else body))
            i = end + 1
            continue
        elif c == '"':
            double = True
        elif c == "\\" and i + 1 < len(word):
            out.append(word[i:i + 2])
            i += 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def read_script(path: str, text: str, variables: dict[str, str] | None = None) -> ShellScript:
    """Evaluate a launch script's assignments and expand its commands (never running them).

    Parameters
    ----------
    path : str
        Named in errors.
    text : str
    variables : dict, optional
        Values for variables the script reads but does not set (``$1``, environment).

    Raises
    ------
    BadInputError
        An unterminated quote, array or expansion, naming the file and line.

    Examples
    --------
    >>> s = read_script("t.sh", 'PP=4\\nARGS=(\\n  --pipeline-model-parallel-size $PP  # pp\\n)\\n'
    ...                  'torchrun x.py ${ARGS[@]} --num-layers $((8*4))')
    >>> s.commands[-1][1]
    ['torchrun', 'x.py', '--pipeline-model-parallel-size', '4', '--num-layers', '32']
    """
    try:
        return _Reader(path, text, dict(variables or {})).run()
    except BadInputError as exc:
        if str(exc).startswith(path):
            raise
        raise BadInputError(f"{path}: {exc}") from None


def split_words(path: str, text: str) -> list[str]:
    """Words of a plain argument list (a file of flags, or a string), quotes honoured."""
    words: list[str] = []
    script = read_script(path, text)
    for _, command in script.commands:
        words += command
    return words
