"""Man pages (roff source) to plain text, without running groff: fast, and the same on every machine.

Only what carries prose is kept: text lines, and the arguments of the font and heading macros
(.SH, .B, .BR, ...). Comments, macro definitions (.de … ..) and layout requests are dropped;
escapes become the characters they print.
"""

from __future__ import annotations

import re

# Macros whose arguments are text; the alternating-font ones (BR, IR, ...) join their arguments
# without spaces, as troff prints them.
_TEXT_MACROS = {"SH", "SS", "B", "I", "SM", "SB", "TP", "IP", "HP", "Sh", "Ip", "UR", "MT", "Nm", "Nd", "Dd"}
_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}

_NAMED = {
    "em": "—", "en": "–", "hy": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”", "oq": "‘", "cq": "’",
    "bu": "•", "co": "©", "rg": "®", "tm": "™", "mu": "×", "de": "°", "+-": "±", "<=": "≤", ">=": "≥",
    "->": "→", "<-": "←", "ti": "~", "ha": "^", "rs": "\\", "ga": "`", "lh": "", "rh": "", "pc": "·",
}

_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\(..|.)"  # font changes
    r"|s[+-]?\d+"  # size changes
    r"|\*(?:\[[^\]]*\]|\(..|.)"  # string registers
    r"|n(?:\[[^\]]*\]|\(..|.)"  # number registers
    r"|\((..)"  # named characters \(xx
    r"|\[([^\]]*)\]"  # named characters \[xx]
    r"|[kvhwlLoxbDZ]'[^']*'"  # motions and drawings with a quoted argument
    r"|(.)"  # any other single-character escape
    r")"
)

_SINGLE = {"-": "-", "e": "\\", "&": "", "0": " ", " ": " ", "~": " ", "|": "", "^": "", "c": "", "%": "",
           "'": "'", "`": "`", ".": ".", "\\": "\\", "t": "\t", "}": "", "{": "", "p": "", "d": "", "u": ""}


def _unescape(text: str) -> str:
    def sub(m: re.Match) -> str:
        named = m.group(1) or m.group(2)
        if named is not None:
            return _NAMED.get(named, "")
        single = m.group(3)
        if single is not None:
            return _SINGLE.get(single, "")
        return ""

    return _ESCAPE.sub(sub, text)


def _args(rest: str) -> list[str]:
    """A macro's arguments: space separated, double quotes group."""
    return [a[1:-1] if a.startswith('"') and a.endswith('"') and len(a) > 1 else a
            for a in re.findall(r'"[^"]*"|\S+', rest)]


def roff_to_text(source: str) -> str:
    out: list[str] = []
    skipping = False
    for line in source.splitlines():
        if skipping:
            if line.strip() == "..":
                skipping = False
            continue
        if line.startswith(('.\\"', "'\\\"", '.\\#')) or line.startswith('\\"'):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], parts[1] if len(parts) > 1 else ""
            if macro in ("de", "de1", "am", "ig"):
                skipping = True
                continue
            if macro in ("SH", "SS"):
                out.append("")
            if macro in _ALTERNATING:
                out.append(_unescape("".join(_args(rest))))
            elif macro in _TEXT_MACROS and rest:
                out.append(_unescape(" ".join(_args(rest))))
            elif macro in ("PP", "LP", "P", "sp", "br", "Pp"):
                out.append("")
            continue
        out.append(_unescape(line))
    return "\n".join(out)
