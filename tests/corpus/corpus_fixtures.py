"""Texts the corpus tests read: a man page, a licensed script, a fortune file."""


MAN_PAGE = r""".\" Copyright (c) 1999 Someone; licensed under the GPL
.de XX
.B never printed
..
.TH GREP 1 "2024" "GNU" "User Commands"
.SH NAME
grep \- print lines that match patterns
.SH DESCRIPTION
.B grep
searches for \fIpatterns\fP in each \fBFILE\fR.
.BR egrep (1)
is the same as \fBgrep \-E\fR.
Text\(emwith a dash and \(lqquotes\(rq.
"""

SCRIPT = """#!/bin/sh
# Copyright 2020 Example Corp.
# Licensed under the Apache License, Version 2.0.
set -e
for f in "$@"; do
  echo "processing $f"
done
"""

FORTUNES = "A day for firm decisions!!!!!  Or is it?\n%\nAdvancement in position.\n%\nx\n%\nAdvancement in position.\n"


