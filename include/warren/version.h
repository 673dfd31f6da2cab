/* Warren's one version string: libwarren (warren_version, its User-Agent),
 * `warren --version`, `warrend --version` and GET /healthz report it. */
#ifndef WARREN_VERSION_H
#define WARREN_VERSION_H

#define WARREN_VERSION "0.1.0"

#endif
