#!/bin/sh
# The lines a host's source marks /* distopt ... */, counted by kind:
#   core     the calls and the control flow that carries them, declarations of distopt's
#            variables included: every marked line that is not a # line, not a comment on its
#            own, and not marked "distopt option" or "distopt layout";
#   option   lines marked /* distopt option ... */ (TernGrad, clipping: choices beyond the drop-in);
#   layout   lines marked /* distopt layout ... */ (describing the host's memory to distopt);
#   include  # lines with the mark (#define DISTOPT_IMPLEMENTATION, the #includes).
# make hosts (examples/hosts/run.sh) and tests/check_gpt2_standin.sh count with it.
# Usage: scripts/count-lines.sh FILE          one line per kind: "core N", "option N", ...
#        scripts/count-lines.sh FILE KIND     the number alone (KIND: core, option, layout, include)
set -u

usage() {
    echo "usage: scripts/count-lines.sh FILE [core|option|layout|include]" >&2
    exit 2
}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
src=$1
[ -r "$src" ] || { echo "count-lines.sh: cannot read $src" >&2; exit 2; }

# grep -c prints 0 and exits 1 when nothing matches: a count of 0 is not an error here.
count() { # $1: kind
    case $1 in
        include) grep -c '^#.*/\* distopt' "$src" ;;
        layout | option) grep -c "/\* distopt $1" "$src" ;;
        core) grep '/\* distopt' "$src" | grep -v '^#' | grep -v '^[[:space:]]*/\*' | grep -vc '/\* distopt \(layout\|option\)' ;;
        *) usage ;;
    esac
    return 0
}

if [ $# -eq 2 ]; then
    count "$2"
else
    for kind in core option layout include; do
        echo "$kind $(count "$kind")"
    done
fi
