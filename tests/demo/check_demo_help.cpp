// ctest Demo.HelpShowsDefaults: `sparse_prefill_demo --help` states the library's selection defaults. Runs the demo
// given as argv[1] and looks, in its help, for each default as SelectionParams{} holds it now, formatted as the demo
// formats it (%g for floats): the help must read them from the library, never restate numbers that may go stale.
//   check_demo_help <path to sparse_prefill_demo>
#include <cstdio>
#include <string>
#include <vector>

#include "sparse_prefill/sparse.h"

namespace {

std::string g(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// The help's line that starts with `option` (after its indentation), or "" when there is none.
std::string option_line(const std::string& help, const std::string& option) {
  for (size_t pos = 0; pos < help.size();) {
    size_t end = help.find('\n', pos);
    if (end == std::string::npos) end = help.size();
    const std::string line = help.substr(pos, end - pos);
    const size_t first = line.find_first_not_of(' ');
    if (first != std::string::npos && line.compare(first, option.size() + 1, option + " ") == 0) {
      // An option's description may continue on the next line (indented further): include it.
      std::string text = line;
      size_t next = end + 1;
      while (next < help.size() && help.compare(next, first + 2, std::string(first + 2, ' ')) == 0) {
        size_t next_end = help.find('\n', next);
        if (next_end == std::string::npos) next_end = help.size();
        text += " " + help.substr(next, next_end - next);
        next = next_end + 1;
      }
      return text;
    }
    pos = end + 1;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: check_demo_help <sparse_prefill_demo>\n");
    return 2;
  }
  FILE* pipe = popen(("'" + std::string(argv[1]) + "' --help").c_str(), "r");
  if (!pipe) {
    std::perror("popen");
    return 1;
  }
  std::string help;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) help.append(buf, n);
  const int rc = pclose(pipe);
  std::printf("%s", help.c_str());
  if (rc != 0) {
    std::fprintf(stderr, "FAIL: --help exited with status %d\n", rc);
    return 1;
  }
  const sparse_prefill::SelectionParams d{};
  // The help joins wrapped lines with newlines; compare with every run of whitespace read as one space.
  std::string flat;
  for (char c : help) {
    const char ch = (c == '\n') ? ' ' : c;
    if (!(ch == ' ' && !flat.empty() && flat.back() == ' ')) flat += ch;
  }
  struct Expect {
    std::string where, text;  // where: an option whose line (and continuation) must hold text; "" = anywhere
  };
  const std::vector<Expect> expected = {
      {"--alpha", "(default " + g(d.alpha) + ";"},
      {"--dense-fraction", "(default " + g(d.dense_fraction) + ";"},
      {"", "alpha " + g(d.alpha) + ","},
      {"", "block " + std::to_string(d.block_size) + ","},
      {"", "sink " + std::to_string(d.sink) + ","},
      {"", "window " + std::to_string(d.window) + ","},
      {"", "last_n " + std::to_string(d.last_n) + ","},
      {"", "head_subgroups " + std::to_string(d.head_subgroups)},
      {"", std::string("correction ") + (d.correction ? "on" : "off")},
      {"", "dense_fraction " + g(d.dense_fraction)},
  };
  int failures = 0;
  for (const Expect& e : expected) {
    const std::string haystack = e.where.empty() ? flat : option_line(help, e.where);
    if (!e.where.empty() && haystack.empty()) {
      std::fprintf(stderr, "FAIL: the help has no line for %s\n", e.where.c_str());
      ++failures;
    } else if (haystack.find(e.text) == std::string::npos) {
      std::fprintf(stderr, "FAIL: %s does not say '%s' (SelectionParams{}'s value)\n",
                   e.where.empty() ? "the help" : ("the help's " + e.where + " line").c_str(), e.text.c_str());
      ++failures;
    }
  }
  if (failures) return 1;
  std::printf("OK: the help states SelectionParams{}'s defaults\n");
  return 0;
}
