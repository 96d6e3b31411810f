#!/bin/sh
# The documentation's C cannot drift from the code. Every ```c block of README.md and docs/*.md
# is one of two kinds, or the check fails naming the page and the line of the block:
#   - a complete program (it contains "int main"): compiled and linked as a user would build it,
#     cc -std=c11 -Wall -Wextra -Wc++-compat -Werror -D_GNU_SOURCE -I<top> with OpenBLAS and
#     -DDOPT_USE_BLAS as the Makefile links it (mpicc when it includes transport_mpi.h), so what
#     it shows also builds in hosts compiled with -Wc++-compat (kann); not run;
#   - an excerpt, announced by the line  <!-- excerpt: FILE -->  right before its fence: every
#     non-blank line of the block, whitespace-trimmed, is a whitespace-trimmed line of FILE, in
#     the block's order (a line that is exactly "..." elides), and FILE is a source that make
#     builds or runs (under examples/, tests/ or bench/) or a header of the top directory.
# Every relative link of those pages ([text](path), ![alt](img/x.png), path#anchor) must name a
# file that exists, and an anchor a heading of that page. compress.h's manual gives the integer
# ring's bits per element as formulas, each followed by figures ("FORMULA bits: V at N = n, V at
# N = n, ..." in BYTES AS THE WORLD GROWS): every figure must be its formula's value at that N to
# the digits printed, and both formulas must be there (this script knows them: change it with the
# text), so the figures cannot drift from the formula beside them. No page, and no header's
# manual (its top comment), initialises a dopt_ struct with "= {0}": C++ refuses it when the
# struct's first field is an enum (dopt_compressor, dopt_compressor_config, dopt_batch_config),
# -Wc++-compat warns about it in C, and g++ -Wextra warns for every struct; a manual's form must
# build in C and in C++ hosts alike. Blocks of other languages (sh, text,
# diff) are not checked. Extracted blocks are left in BUILD_DIR/check_docs.
# Before the pages, the check runs itself on pages made to fail (a typo in an excerpt, lines out
# of order, an unannounced fragment, a program that does not compile, an excerpt of a file make
# does not use, a dead link): a check that could not fail fails.
# Usage: tests/check_docs.sh BUILD_DIR           (tests/run.sh passes it; exit 0 pass, 1 fail,
#                                                 77 skipped)
#        tests/check_docs.sh --self-test [BUILD_DIR]   the self-test alone
set -u
cd "$(dirname "$0")/.." || exit 1
TOP=$(pwd)

self_only=0
if [ "${1:-}" = --self-test ]; then self_only=1; shift; fi
BUILD=${1:-build}
WORK="$BUILD/check_docs"
rm -rf "$WORK"
mkdir -p "$WORK" || exit 1

command -v cc >/dev/null 2>&1 || { echo "check_docs: skipped: no C compiler (cc) to build the documentation's programs"; exit 77; }
BLAS_CFLAGS="$(pkg-config --cflags openblas 2>/dev/null) -DDOPT_USE_BLAS"
BLAS_LIBS=$(pkg-config --libs openblas 2>/dev/null || echo -lopenblas)

# Counters of one run of check_pages.
programs=0 excerpts=0 links=0 figures=0 failures=0

fail() { # $1: page:line, $2: what is wrong, $3: what to do (may be empty)
    echo "FAIL $1: $2"
    [ -z "$3" ] || echo "     $3"
    failures=$((failures + 1))
}

# Splits a page into its ```c blocks: writes DIR/bN.c for each and prints one manifest line per
# block, "N LINE EXCERPT_FILE_OR_- HAS_MAIN", LINE being the page's line of the opening fence; an
# unterminated fence prints "unterminated LINE".
split_blocks() { # $1: page, $2: directory
    awk -v dir="$2" '
        function lang_of(s) { sub(/^[ \t]*```+[ \t]*/, "", s); sub(/[ \t]+.*$/, "", s); return tolower(s) }
        !fence && /^[ \t]*```/ {
            fence = 1; start = NR; c = (lang_of($0) == "c"); has_main = 0
            if (c) {
                n++; file = dir "/b" n ".c"; printf "" > file
                ex = "-"
                if (prev ~ /^[ \t]*<!--[ \t]*excerpt:[ \t]*[^ \t]+[ \t]*-->[ \t]*$/) {
                    ex = prev; sub(/^[ \t]*<!--[ \t]*excerpt:[ \t]*/, "", ex); sub(/[ \t]*-->[ \t]*$/, "", ex)
                }
            }
            prev = $0; next
        }
        fence && /^[ \t]*```[ \t]*$/ {
            if (c) { close(file); print n, start, ex, has_main }
            fence = 0; prev = $0; next
        }
        fence && c { print > file; if ($0 ~ /int[ \t]+main[ \t]*\(/) has_main = 1 }
        { prev = $0 }
        END { if (fence) print "unterminated", start }
    ' "$1"
}

# 0 when FILE may be excerpted: a source make builds or runs, or a top-level header.
excerptable() {
    case "$1" in
        *..*) return 1 ;;
        examples/*.c | examples/*.h | tests/*.c | tests/*.h | bench/*.c | bench/*.h) ;;
        */*) return 1 ;;
        *.h) ;;
        *) return 1 ;;
    esac
    [ -f "$PAGES_TOP/$1" ]
}

# Prints the block's first line (its index in the block, then the line) that is not found, in
# order, among the source's lines, or "empty" for a block with nothing to match; silent when the
# excerpt matches.
excerpt_mismatch() { # $1: source file, $2: block
    awk '
        function trim(s) { sub(/^[ \t\r]+/, "", s); sub(/[ \t\r]+$/, "", s); return s }
        FNR == NR { src[++ns] = trim($0); next }
        {
            t = trim($0)
            if (t == "" || t == "...") next
            seen++
            while (++pos <= ns && src[pos] != t) {}
            if (pos > ns) { print FNR, $0; bad = 1; exit }
        }
        END { if (!bad && !seen) print "empty" }
    ' "$1" "$2"
}

compile_program() { # $1: block, $2: page, $3: line of its fence, $4: executable to write
    cc=cc
    grep -q '#[[:space:]]*include[[:space:]]*"transport_mpi.h"' "$1" && cc=mpicc
    # the compiler's messages name the page and its lines
    { printf '#line %d "%s"\n' $(($3 + 1)) "$2"; cat "$1"; } >"$1.src.c"
    # shellcheck disable=SC2086
    $cc -std=c11 -Wall -Wextra -Wc++-compat -Werror -D_GNU_SOURCE -I"$PAGES_TOP" $BLAS_CFLAGS -o "$4" "$1.src.c" \
        $BLAS_LIBS -lm -lpthread -lrt >"$1.log" 2>&1
}

# The headings of a page as GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
anchors_of() { # $1: page
    awk '/^[ \t]*```/ { fence = !fence; next }
         !fence && /^#+[ \t]/ {
             s = tolower($0); sub(/^#+[ \t]+/, "", s); gsub(/[^a-z0-9 _-]/, "", s); gsub(/ /, "-", s); print s
         }' "$1"
}

check_links() { # $1: page (relative to PAGES_TOP)
    dir=$(dirname "$1")
    awk '/^[ \t]*```/ { fence = !fence; next }
         !fence {
             s = $0
             while (match(s, /\]\([^) \t]+\)/)) {
                 print FNR, substr(s, RSTART + 2, RLENGTH - 3); s = substr(s, RSTART + RLENGTH)
             }
         }' "$PAGES_TOP/$1" >"$WORK/links"
    while read -r line target; do
        case "$target" in http://* | https://* | mailto:*) continue ;; esac
        links=$((links + 1))
        path=${target%%#*}
        anchor=
        case "$target" in *'#'*) anchor=${target#*#} ;; esac
        if [ -z "$path" ]; then file="$1"; elif [ "$dir" = . ]; then file=$path; else file="$dir/$path"; fi
        if [ ! -e "$PAGES_TOP/$file" ]; then
            fail "$1:$line" "link to $target: no such file ($file)" "fix the path (relative to the page's directory, $dir)"
        elif [ -n "$anchor" ] && ! anchors_of "$PAGES_TOP/$file" | grep -qxF -- "$anchor"; then
            fail "$1:$line" "link to $target: $file has no heading with that anchor" \
                "anchors are headings in lower case, punctuation dropped, spaces as hyphens"
        fi
    done <"$WORK/links"
}

check_page() { # $1: page (relative to PAGES_TOP)
    page=$1
    out="$WORK/$(echo "$page" | tr / _)"
    mkdir -p "$out"
    split_blocks "$PAGES_TOP/$page" "$out" >"$out/manifest"
    while read -r n line ex has_main; do
        if [ "$n" = unterminated ]; then
            fail "$page:$line" "a fenced block that never ends" "close it with a line of \`\`\`"
            continue
        fi
        block="$out/b$n.c"
        if [ "$ex" != - ]; then
            if ! excerptable "$ex"; then
                fail "$page:$line" "excerpt of $ex, which is not a source that make builds or runs" \
                    "name a file under examples/, tests/ or bench/, or a top-level header, relative to the top"
                continue
            fi
            miss=$(excerpt_mismatch "$PAGES_TOP/$ex" "$block")
            if [ "$miss" = empty ]; then
                fail "$page:$line" "an excerpt of $ex with no line to match" "show some of $ex, or remove the block"
            elif [ -n "$miss" ]; then
                fail "$page:$((line + ${miss%% *}))" "this line of the excerpt is not in $ex (after the lines before it): ${miss#* }" \
                    "copy it from $ex as it is now (whitespace aside; a line \"...\" elides), or change the block"
            else
                excerpts=$((excerpts + 1))
            fi
        elif [ "$has_main" = 1 ]; then
            if compile_program "$block" "$page" "$line" "$out/b$n"; then
                programs=$((programs + 1))
            else
                fail "$page:$line" "this program does not compile and link:" ""
                sed -n '1,20p' "$block.log" | sed 's/^/     /'
            fi
        else
            fail "$page:$line" "a \`\`\`c block that is neither a complete program nor an announced excerpt" \
                "make it a program with int main that compiles, or put <!-- excerpt: path/to/file --> on the line before the fence"
        fi
    done <"$out/manifest"
    check_links "$page"
}

# Prints one line per figure of the header's BYTES AS THE WORLD GROWS that is not its formula's
# value (to the digits printed), or per formula missing or without figures; then "figures K".
ring_bits_mismatch() { # $1: header
    awk '
        function width(x,   b) { b = 0; while (2 ^ b < x) b++; return b }   # ceil(log2(x))
        function mean(n,   k, s) {
            for (k = 1; k < n; k++) s += width(2 * k + 1)
            return (s + (n - 1) * width(2 * n + 1)) / n
        }
        /BYTES AS THE WORLD GROWS/ { on = 1; next }
        on && /^[ \t]*$/ { on = 0 }
        on { t = t " " $0 }
        END {
            gsub(/[ \t]+/, " ", t)
            f[1] = "(Σ_{k=1}^{N-1} ceil(log2(2k + 1)) + (N - 1)·ceil(log2(2N + 1)))/N bits: "
            f[2] = "2·ceil(log2(2N + 1)) bits: "
            for (i = 1; i <= 2; i++) {
                p = index(t, f[i])
                if (!p) { print "the formula \"" f[i] "\" is not there"; continue }
                rest = substr(t, p + length(f[i]))
                seen = 0
                while (match(rest, /^[0-9]+(\.[0-9]+)? at N = [0-9]+/)) {
                    split(substr(rest, 1, RLENGTH), a, " at N = ")
                    rest = substr(rest, RLENGTH + 1)
                    d = index(a[1], ".") ? length(a[1]) - index(a[1], ".") : 0
                    x = i == 1 ? mean(a[2] + 0) : 2 * width(2 * a[2] + 1)
                    if (sprintf("%." d "f", x) != a[1])
                        print "\"" a[1] " at N = " a[2] "\" after \"" f[i] "\": the formula gives " sprintf("%.4f", x)
                    seen++
                    if (!match(rest, /^(,| and) /)) break
                    rest = substr(rest, RLENGTH + 1)
                }
                if (!seen) print "the formula \"" f[i] "\" has no figures after it (\"V at N = n, ...\")"
                figures += seen
            }
            print "figures", figures + 0
        }
    ' "$1"
}

check_figures() { # $1: header (relative to PAGES_TOP)
    ring_bits_mismatch "$PAGES_TOP/$1" >"$WORK/figures"
    while read -r line; do
        case "$line" in
            "figures "*) figures=$((figures + ${line#figures })) ;;
            *) fail "$1: BYTES AS THE WORLD GROWS" "$line" \
                "print each figure as the formula before it gives it (or change the formula here and in the text)" ;;
        esac
    done <"$WORK/figures"
}

# Fails every line of the file (a page, or with $2 = manual a header's top comment alone) that
# initialises a dopt_ struct with "= {0}".
check_zero_inits() { # $1: file (relative to PAGES_TOP), $2: "page" or "manual"
    awk -v part="$2" '
        part == "manual" && /\*\// { print_end = 1 }
        /dopt_[a-z0-9_]+[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*=[ \t]*\{[ \t]*0[ \t]*\}/ { print FNR }
        print_end { exit }
    ' "$PAGES_TOP/$1" >"$WORK/zero_inits"
    while read -r line; do
        fail "$1:$line" "a dopt_ struct initialised with \"= {0}\", which C++ refuses (an enum first field) or warns about, as -Wc++-compat does" \
            "drop it where an init sets every field (dopt_compressor_init does), else memset(&x, 0, sizeof x)"
    done <"$WORK/zero_inits"
}

# Checks every page given, relative to PAGES_TOP; sets the counters.
check_pages() {
    programs=0 excerpts=0 links=0 figures=0 failures=0
    for p in "$@"; do
        check_page "$p"
        check_zero_inits "$p" page
    done
}

# The self-test: a small repository whose pages must pass or fail as stated.
self_test() {
    st="$WORK/self-test"
    mkdir -p "$st/examples" "$st/docs"
    cat >"$st/examples/loop.c" <<'EOF'
int main(void) {
    int step, x = 0;
    for (step = 0; step < 10; step++) {
        x += step;
    }
    return x == 45 ? 0 : 1;
}
EOF
    cat >"$st/notes.txt" <<'EOF'
    x += step;
EOF
    fence='```'
    good="<!-- excerpt: examples/loop.c -->
${fence}c
for (step = 0; step < 10; step++) {
    ...
        x += step;

}
${fence}

${fence}c
int main(void) { return 0; }
${fence}

${fence}sh
cc loop.c
${fence}

[the loop](../examples/loop.c), [a heading](#a-heading-here)
## A heading, here"
    printf '%s\n' "$good" >"$st/docs/good.md"
    mk() { # $1: name, $2: page text
        printf '%s\n' "$2" >"$st/docs/$1.md"
    }
    mk typo "<!-- excerpt: examples/loop.c -->
${fence}c
for (step = 0; step < 10; stepp++) {
${fence}"
    mk order "<!-- excerpt: examples/loop.c -->
${fence}c
x += step;
for (step = 0; step < 10; step++) {
${fence}"
    mk fragment "${fence}c
x += step;
${fence}"
    mk warning "${fence}c
int main(void) { int unused; return 0; }
${fence}"
    mk outside "<!-- excerpt: notes.txt -->
${fence}c
x += step;
${fence}"
    mk elided "<!-- excerpt: examples/loop.c -->
${fence}c
...
${fence}"
    mk deadlink "[gone](../examples/gone.c)"
    mk deadanchor "[nowhere](good.md#no-such-heading)"
    mk unterminated "${fence}c
int main(void) { return 0; }"
    mk cxxcompat "${fence}c
enum color { RED };
struct paint { enum color c; int n; };
int main(void) { struct paint p = {0}; return p.n; }
${fence}"
    mk zeroinit "<!-- excerpt: examples/loop.c -->
${fence}c
    x += step;
${fence}

    dopt_compressor tern = {0};"

    saved_top=$PAGES_TOP saved_work=$WORK
    PAGES_TOP=$st WORK=$st/out
    mkdir -p "$WORK"
    check_pages docs/good.md >"$st/log" 2>&1
    if [ "$failures" -ne 0 ] || [ "$programs" -ne 1 ] || [ "$excerpts" -ne 1 ] || [ "$links" -ne 2 ]; then
        PAGES_TOP=$saved_top WORK=$saved_work
        echo "check_docs: SELF-TEST FAILED: a good page gave $failures failures, $programs programs, $excerpts excerpts, $links links (want 0, 1, 1, 2):"
        cat "$st/log"
        return 1
    fi
    refused=0
    # each page made to fail, and the words its failure must give
    for case in "typo:is not in" "order:is not in" "fragment:neither a complete program" \
        "warning:does not compile" "outside:not a source that make" "elided:no line to match" \
        "deadlink:no such file" "deadanchor:no heading with that anchor" "unterminated:never ends" \
        "cxxcompat:does not compile" "zeroinit:initialised with"; do
        name=${case%%:*}
        check_pages "docs/$name.md" >"$st/log" 2>&1
        if [ "$failures" -eq 0 ] || ! grep -qF -- "${case#*:}" "$st/log"; then
            PAGES_TOP=$saved_top WORK=$saved_work
            echo "check_docs: SELF-TEST FAILED: docs/$name.md, made to fail with \"${case#*:}\", gave:"
            cat "$st/log"
            echo "for the page:"
            cat "$st/docs/$name.md"
            return 1
        fi
        refused=$((refused + 1))
    done
    # the ring's figures: right, one wrong (the bound's formula beside the mean's figures, as the
    # text once had it), a formula gone
    figure_text() { # $1: the line of figures after the mean's formula, $2: the bound's
        printf '   BYTES AS THE WORLD GROWS\n     a rank receives\n     %s\n     and below %s\n\n   next\n' \
            "(Σ_{k=1}^{N-1} ceil(log2(2k + 1)) + (N - 1)·ceil(log2(2N + 1)))/N bits: $1." \
            "$2"
    }
    figure_text "2.5 at N = 2, 3.667 at N = 3, 5 at N = 4, 7.375 at N = 8, 13.875 at N = 64" \
        "2·ceil(log2(2N + 1)) bits: 8 at N = 4, 10 at N = 8 and 16 at N = 64" >"$st/good.h"
    figure_text "2.5 at N = 2, 5 at N = 4" "2·ceil(log2(2N + 1)) bits: 5 at N = 4, 7.4 at N = 8" >"$st/wrong.h"
    figure_text "2.5 at N = 2" "2·ceil(log2(N)) bits: 4 at N = 4" >"$st/gone.h"
    # a header's manual with "= {0}" fails; the same after its top comment (code) does not
    printf '/* x.h\n\n       dopt_batch_config bcfg = {0};\n*/\n' >"$st/manual.h"
    printf '/* x.h */\nstatic dopt_span none = {0};\n' >"$st/code.h"
    failures=0
    check_zero_inits code.h manual >"$st/log" 2>&1
    check_zero_inits manual.h manual >>"$st/log" 2>&1
    if [ "$failures" -ne 1 ] || ! grep -qF "manual.h:3: a dopt_ struct initialised with" "$st/log"; then
        PAGES_TOP=$saved_top WORK=$saved_work
        echo "check_docs: SELF-TEST FAILED: a manual's \"= {0}\" (and not code's) should fail, gave:"
        cat "$st/log"
        return 1
    fi
    refused=$((refused + 1))
    failures=0 figures=0
    check_figures good.h >"$st/log" 2>&1
    if [ "$failures" -ne 0 ] || [ "$figures" -ne 8 ]; then
        PAGES_TOP=$saved_top WORK=$saved_work
        echo "check_docs: SELF-TEST FAILED: right figures gave $failures failures, $figures figures (want 0, 8):"
        cat "$st/log"
        return 1
    fi
    for case in "wrong:\"7.4 at N = 8\" after" "gone:2·ceil(log2(2N + 1)) bits: \" is not there"; do
        failures=0
        check_figures "${case%%:*}.h" >"$st/log" 2>&1
        if [ "$failures" -eq 0 ] || ! grep -qF -- "${case#*:}" "$st/log"; then
            PAGES_TOP=$saved_top WORK=$saved_work
            echo "check_docs: SELF-TEST FAILED: ${case%%:*}.h, made to fail with \"${case#*:}\", gave:"
            cat "$st/log"
            return 1
        fi
        refused=$((refused + 1))
    done
    PAGES_TOP=$saved_top WORK=$saved_work
    echo "check_docs: self-test: a good page and good figures passed, $refused pages and figures made to fail were refused"
}

PAGES_TOP=$TOP
self_test || exit 1
[ "$self_only" -eq 0 ] || exit 0

pages="README.md" npages=1
for p in docs/*.md; do
    [ -f "$p" ] || continue
    pages="$pages $p" npages=$((npages + 1))
done
# shellcheck disable=SC2086
check_pages $pages
for h in *.h; do check_zero_inits "$h" manual; done
check_figures compress.h
echo "check_docs: $npages pages: $programs programs compiled, $excerpts excerpts matched, $links links resolved; compress.h: $figures figures computed; $failures failures"
if [ "$failures" -ne 0 ]; then
    echo "check_docs: FAILED: the documentation no longer matches the code (extracted blocks in $WORK)"
    exit 1
fi
exit 0
