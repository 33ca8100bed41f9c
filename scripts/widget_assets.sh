#!/usr/bin/env bash
# Fetch the JavaScript that renders ipywidgets in an exported (static) HTML page, from the npm
# registry, into a git-ignored folder (default runs/widget_assets/):
#
#   @jupyter-widgets/html-manager  dist/embed-amd.js: the widget manager, with @jupyter-widgets/base,
#                                  /controls and /output bundled in (only third-party widget
#                                  modules would be fetched from a CDN at run time; we use none);
#   requirejs                      require.js: the AMD loader embed-amd.js needs.
#
# html-manager 1.0.x goes with ipywidgets 8.x (widget state format 2.x). Re-runnable: a version
# already unpacked is kept. Prints the folder. Override the versions with HTML_MANAGER_VERSION /
# REQUIREJS_VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${ASSETS:-runs/widget_assets}
HTML_MANAGER_VERSION=${HTML_MANAGER_VERSION:-1.0.15}
REQUIREJS_VERSION=${REQUIREJS_VERSION:-2.3.8}

if ! command -v npm >/dev/null; then
  echo "npm not found: installing it (apt-get install -y npm)" >&2
  apt-get update -qq && apt-get install -y -qq npm >/dev/null
fi
mkdir -p "$ASSETS"

fetch() {   # fetch PACKAGE VERSION DIR: npm pack PACKAGE@VERSION and unpack it into ASSETS/DIR
  local pkg=$1 version=$2 dir=$ASSETS/$3
  if [ -f "$dir/.version" ] && [ "$(cat "$dir/.version")" = "$version" ]; then
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$pkg@$version" >/dev/null)
  rm -rf "$dir" && mkdir -p "$dir"
  tar xzf "$tmp"/*.tgz -C "$dir" --strip-components=1   # the tarball's top folder is package/
  rm -rf "$tmp"
  echo "$version" >"$dir/.version"
  echo "fetched $pkg@$version -> $dir" >&2
}

fetch @jupyter-widgets/html-manager "$HTML_MANAGER_VERSION" html-manager
fetch requirejs "$REQUIREJS_VERSION" requirejs
test -f "$ASSETS/html-manager/dist/embed-amd.js" && test -f "$ASSETS/requirejs/require.js"
echo "$ASSETS"
