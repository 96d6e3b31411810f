#!/bin/sh
# Library hygiene, checked on every header in the repository root:
# - every external symbol the implementation defines starts with dopt_ (hosts such as darknet and
#   llm.c export generic names; ours must never collide with theirs);
# - no exit(), abort(), printing to stdout/stderr, rand()/srand() in library code (but for
#   launch.h's default logger, which its manual documents);
# - no mutable file-scope state (static or global variables) in the implementation;
# - every private name (dopt__*, DOPT__*) a header takes from a header it includes is declared in
#   that header's FOR MODULES / FOR BACKENDS section (self-tested on two small headers first).
# Usage: tests/check_hygiene.sh BUILD_DIR
set -eu
BUILD=${1:-build}
cd "$(dirname "$0")/.."
status=0
headers=$(ls distopt.h engine.h transport_*.h clip.h compress.h localsgd.h launch.h 2>/dev/null | grep -v transport_mpi.h || true)

src="$BUILD/hygiene_all.c"
obj="$BUILD/hygiene_all.o"
{
    echo "#define DISTOPT_IMPLEMENTATION"
    for h in $headers; do echo "#include \"../$h\""; done
} > "$src"
cc -std=c11 -D_GNU_SOURCE -O1 $(pkg-config --cflags openblas 2>/dev/null) -c "$src" -o "$obj"
objs="$obj"
if [ -f transport_mpi.h ]; then
    printf '#define DISTOPT_IMPLEMENTATION\n#include "../distopt.h"\n#include "../transport_mpi.h"\n' > "$BUILD/hygiene_mpi.c"
    mpicc -std=c11 -D_GNU_SOURCE -O1 $(pkg-config --cflags openblas 2>/dev/null) -c "$BUILD/hygiene_mpi.c" -o "$BUILD/hygiene_mpi.o"
    objs="$objs $BUILD/hygiene_mpi.o"
    headers="$headers transport_mpi.h"
fi
bad=$(for o in $objs; do nm -g --defined-only "$o"; done | awk '{print $3}' | grep -v '^dopt_' || true)
if [ -n "$bad" ]; then
    echo "public symbols without the dopt_ prefix:"; echo "$bad"; status=1
fi
# Objects in .data or .bss mean file-scope mutable state (.data.rel.ro holds const tables).
data=$(for o in $objs; do objdump -t "$o"; done | awk '$4 == ".data" || $4 == ".bss" || $3 == ".data" || $3 == ".bss" {print $NF}' | grep -v '^\.' || true)
if [ -n "$data" ]; then
    echo "mutable file-scope variables:"; echo "$data"; status=1
fi
for h in $headers; do
    # strip comments and string literals before looking for calls
    hits=$(sed -e 's://.*$::' "$h" | perl -0pe 's:/\*.*?\*/::gs; s/"(\\.|[^"\\])*"/""/g' |
        grep -nE '(^|[^_a-zA-Z0-9.>])(exit|_Exit|abort|printf|fprintf|puts|fputs|perror|rand|srand)[ ]*\(' || true)
    # the one documented exception: launch.h's default logger, so that a one-call start that
    # fails without a log_fn still says why (its manual says so)
    [ "$h" = launch.h ] && hits=$(printf '%s\n' "$hits" | grep -vE '^[0-9]+: +if \(level <= upto\) fprintf\(stderr, "", message\);$' || true)
    # and the end of a failed job: dopt_comm_finish prints the communicator's detail once, so the
    # job's last words need no line of the host's (distopt.h's manual says so)
    [ "$h" = distopt.h ] && hits=$(printf '%s\n' "$hits" | grep -vE '^[0-9]+: +if \(status != 0 && c->detail\[0\] && c->log_fn == NULL\) fprintf\(stderr, "", c->detail\);$' || true)
    if [ -n "$hits" ]; then
        echo "$h: forbidden call (exit/abort/printing/rand):"; echo "$hits"; status=1
    fi
done
# Private names across headers: H uses G's dopt__x (G defines it, H includes G and does not
# define it itself) only when G's FOR MODULES / FOR BACKENDS section names it.
crossings() { # header files
    perl - "$@" <<'PERL'
use strict; use warnings;
my (%defs, %uses, %allowed, %inc);
for my $h (@ARGV) {
    open my $f, '<', $h or die "$h: $!"; local $/; my $t = <$f>; close $f;
    if ($t =~ /={5,} FOR (?:MODULES|BACKENDS)\b(.*?)(?:\n\/\* ={5,} |\n#ifdef __cplusplus\n\}|\z)/s) { $allowed{$h}{$_} = 1 for $1 =~ /\b((?:dopt|DOPT)__\w+)/g; }
    my $code = $t; $code =~ s{/\*.*?\*/}{}gs; $code =~ s{//[^\n]*}{}g;
    $inc{$h}{$1} = 1 while $code =~ /^\s*#\s*include\s+"(?:\.\.\/)?([\w.]+)"/mg;
    $code =~ s/"(\\.|[^"\\])*"/""/g;
    $defs{$h}{$1} = 1 while $code =~ /^(?:DOPT__MAYBE_UNUSED\s+)?static\s+[\w\s\*]*?\b(dopt__\w+)\s*\(/mg;
    $defs{$h}{$1} = 1 while $code =~ /^\s*#\s*define\s+(DOPT__\w+)/mg;
    $defs{$h}{$1} = 1 while $code =~ /\}\s*(dopt__\w+)\s*;/g;
    $uses{$h}{$1} = 1 while $code =~ /\b((?:dopt|DOPT)__\w+)/g;
}
my $bad = 0;
for my $h (@ARGV) { for my $g (@ARGV) { next if $g eq $h || !$inc{$h}{$g}; # names of the headers h includes
    for my $n (sort keys %{$uses{$h}}) {
        next unless $defs{$g}{$n} && !$defs{$h}{$n};
        next if $allowed{$g}{$n};
        print "$h uses $g\'s $n, which $g does not declare in its FOR MODULES / FOR BACKENDS section\n"; $bad++;
    } } }
exit($bad ? 1 : 0);
PERL
}
t=$(mktemp -d)
printf 'static int dopt__x(void) { return 1; }\n/* ===== FOR MODULES\n   %s */\n' "" >"$t/a.h"
printf '#include "a.h"\nstatic int dopt__y(void) { return dopt__x(); }\n' >"$t/b.h"
if (cd "$t" && crossings a.h b.h >/dev/null); then
    echo "check_hygiene self-test: an undeclared crossing was not found"; status=1
fi
printf 'static int dopt__x(void) { return 1; }\n/* ===== FOR MODULES\n   dopt__x: one */\n' >"$t/a.h"
if ! (cd "$t" && crossings a.h b.h >/dev/null); then
    echo "check_hygiene self-test: a declared crossing was refused"; status=1
fi
rm -rf "$t"
crossings $headers || status=1
exit $status
