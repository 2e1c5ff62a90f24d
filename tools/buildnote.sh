#!/bin/sh
# make run's note before it builds (make buildnote; TestMakeRunSaysItIsBuilding).
# It asks go list why each binary make run builds is stale: when Go's build
# cache lacks packages from outside this module (a cold cache: the standard
# library, the dependencies), the build compiles everything, which takes
# minutes; when only this module's packages changed, seconds; when the cache
# holds it all, nothing is said.
# Usage: buildnote.sh GO TAGS PACKAGE...
set -eu
go=$1 tags=$2
shift 2
reasons=$("$go" list -tags "$tags" -f '{{.StaleReason}}' "$@")
mod=$("$go" list -m)
cold=$(printf '%s\n' "$reasons" | grep '^stale dependency: ' | grep -v "^stale dependency: $mod/" || true)
# Only a stale package of this module means a rebuild: the binaries' own
# reason ("build ID mismatch", "not installed…") compares them with an
# installed copy make run never uses (it builds with -o).
changed=$(printf '%s\n' "$reasons" | grep "^stale dependency: $mod/" || true)
if [ -n "$cold" ]; then
	echo "make run: building nexus-broker, nexus-spawnd and nexus-echo. Go's build cache does not hold what they import yet, so this first build compiles everything: about two minutes on two cores (later builds take seconds)."
elif [ -n "$changed" ]; then
	echo "make run: rebuilding what changed (seconds)."
fi
