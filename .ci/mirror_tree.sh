#!/usr/bin/env bash
# Mirror the working tree (tracked and untracked files, not ignored ones: no build outputs) into
# DEST, for a build there that never touches the repository's own:
#
#   bash .ci/mirror_tree.sh DEST      (run from the repository root; prints "N files, M new or
#                                      changed")
#
# Only files whose content differs are copied, and they get a fresh modification time: ninja then
# recompiles exactly what changed since the last mirror (mtimes copied from the tree could be
# older than objects built from an earlier copy). Files the last mirror brought that are gone
# from the tree leave DEST (DEST/.mirrored lists them); what a build wrote there stays.
set -euo pipefail
DEST=$1
mkdir -p "$DEST"
MANIFEST=$DEST/.mirrored
declare -A IN_TREE=()
n_copied=0
while IFS= read -r -d '' f; do
  [[ -e $f ]] || continue
  IN_TREE[$f]=1
  if ! cmp -s "$f" "$DEST/$f"; then
    mkdir -p "$DEST/$(dirname "$f")"
    cp "$f" "$DEST/$f"
    n_copied=$((n_copied + 1))
  fi
done < <(git ls-files -z -co --exclude-standard)
if [[ -f $MANIFEST ]]; then
  while IFS= read -r -d '' f; do
    [[ -n ${IN_TREE[$f]:-} ]] || rm -f "$DEST/$f"
  done <"$MANIFEST"
fi
printf '%s\0' "${!IN_TREE[@]}" >"$MANIFEST"
echo "${#IN_TREE[@]} files, $n_copied new or changed"
