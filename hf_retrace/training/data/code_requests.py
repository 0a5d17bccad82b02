"""Which chat prompts ask for code: a keyword and pattern classifier (write, fix or explain code).

Chat prompts that ask for code are the second source of code data beside the library functions of
``code_prompts``. The rule is deliberately simple and tested on labelled examples (``tests/test_code_prompts.py``):

- code in the prompt (a fenced block, a ``def``/``function``/``class`` header, ``#include``, an SQL query, a stack
  trace, several lines ending in ``;``/``{``/``}``) makes it a code prompt: *fix* when it mentions an error or a
  bug, *explain* when it asks what the code does, *write* otherwise;
- without code, a request verb (write, create, build, fix, explain ...) near a code artefact (function, script,
  program, query, regex, API, class, component ...) or a programming language/framework makes it one.

Example::

    code_request_kind("Write a python function that reverses a list")   # "write"
    code_request_kind("Why does this fail?\\n```js\\nfoo(;\\n```")       # "fix"
    code_request_kind("Give me a brief history of Berlin")              # None
"""

from __future__ import annotations

import re

_CODE_IN_TEXT = re.compile(
    r"```|^\s*(def|class|async def)\s+\w+.*:\s*$|^\s*(public|private|static)\s.*[({]\s*$|\bfunction\s*\w*\s*\(|"
    r"#include\s*<|^\s*(import|from)\s+[\w.]+(\s+import\s+[\w.*]+)?\s*;?\s*$|\bconsole\.log\(|\bprint\(|"
    r"\bSELECT\s.+\sFROM\s|\bCREATE\s+TABLE\b|Traceback \(most recent call last\)|^\s*<(div|html|script)\b|"
    r"=>\s*\{|\w+\.\w+\([^)]*\)\s*;|\b(the following|this|my|your|the above|below) (code|function|script|query)\b|"
    r"\bleetcode\b",
    re.IGNORECASE | re.MULTILINE,
)
_LANGUAGES = (  # names that are rarely anything but code (not "rust", "julia", "bash", "react" alone)
    r"python|javascript|typescript|java|c\+\+|c#|golang|kotlin|php|ruby on rails|perl|scala|haskell|matlab|"
    r"swiftui|powershell|shell script|bash script|sql|mysql|postgres(?:ql)?|sqlite|mongodb|html|css|jquery|"
    r"react(?:\.js|js| native| components?| hooks?| app)|node\.?js|vue\.?js|angularjs|django|flask|fastapi|"
    r"laravel|spring boot|pandas|numpy|pytorch|tensorflow|keras|opencv|scikit-learn|sklearn|regex|"
    r"regular expressions?|json|yaml|dockerfile|docker-compose|kubernetes|terraform|solidity|vba|excel formula|"
    r"google apps script|arduino|verilog|vhdl|rust code|c code|c program|unity script|c# script|ruby|redis|graphql|"
    r"next\.?js|express\.?js|tailwind|chakra ui|k8s|smart contracts?|selenium|git commands?"
)
_ARTEFACTS = (  # things only code is: "program", "class", "table" and "app" are too often something else
    r"code|source code|function|snippet|regex|regular expression|api|endpoint|unit tests?|algorithm|"
    r"chrome extension|dockerfile|macro|cli|command[- ]line tool|program (?:that|to|which|in)|script to|sql|query"
)
_VERBS = (
    r"write|create|build|make|generate|implement|code|develop|give me|show me|provide|convert|rewrite|"
    r"refactor|optimi[sz]e|fix|debug|correct|explain|modify|update|add|translate|port|complete"
)
_REQUEST = re.compile(rf"\b({_VERBS})\b[^.?!\n]{{0,80}}?\b({_ARTEFACTS})s?\b", re.IGNORECASE)
_LANGUAGE_REQUEST = re.compile(  # a request and a language in the same sentence, either order
    rf"\b({_VERBS}|how (?:do|can|to|would|should))\b[^.?!\n]{{0,80}}?(?<![\w+#])({_LANGUAGES})(?![\w+#])|"
    rf"(?<![\w+#])({_LANGUAGES})(?![\w+#])[^.?!\n]{{0,40}}?\b({_VERBS}|how (?:do|can|to|would|should))\b",
    re.IGNORECASE,
)
_FIX = re.compile(
    r"\b(fix|debug|bug|error|exception|traceback|doesn'?t work|does not work|not working|fails?|failing|"
    r"wrong|issue|problem with (?:my|this|the) code|warning)\b",
    re.IGNORECASE,
)
_EXPLAIN = re.compile(
    r"\b(explain|what does|what is this|walk me through|how does (?:this|the|it)|describe (?:this|the) code|"
    r"comment (?:this|the) code)\b",
    re.IGNORECASE,
)
_CODE_LINE_ENDINGS = re.compile(r"[;{}]\s*$", re.MULTILINE)

CODE_REQUEST_KINDS: tuple[str, ...] = ("write", "fix", "explain")


def contains_code(text: str) -> bool:
    """Whether the text holds code: a code pattern, or three or more lines ending in ``;``, ``{`` or ``}``."""
    return bool(_CODE_IN_TEXT.search(text)) or len(_CODE_LINE_ENDINGS.findall(text)) >= 3


def code_request_kind(text: str) -> str | None:
    """``"write"``, ``"fix"`` or ``"explain"`` when the prompt asks for code, else ``None`` (see the module)."""
    has_code = contains_code(text)
    asks = bool(_REQUEST.search(text) or _LANGUAGE_REQUEST.search(text))
    if not has_code and not asks:
        return None
    if _FIX.search(text) and (has_code or re.search(r"\b(fix|debug)\b", text, re.IGNORECASE)):
        return "fix"
    if _EXPLAIN.search(text) and (has_code or re.search(r"\bcode\b", text, re.IGNORECASE)):
        return "explain"
    return "write"
