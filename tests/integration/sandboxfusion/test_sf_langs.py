"""SandboxFusion's languages beyond base:bookworm (issue 11 item 2), run
through /run_code wherever their image has been built here.

A language is tested when scripts/mk-lang-rootfs.sh has its layer cached
(`warren image defaults --lang LANG` or the script itself builds it, a few
minutes each); otherwise its tests skip visibly, naming the command that
builds it. These images are built on request only, so a missing one is a
plain skip, not conftest.need(). One daemon serves every cached language:
`warren image defaults --lang LIST` imports base:bookworm and the language
images into it, and `--compat-image LANG=lang-LANG:bookworm` routes each
language to its image.

Per language: hello world on stdout, stdin echoed, a runtime error with its
return code and stderr, a time limit, and for compiled languages a compile
error (Failed, compile_result with a non-zero return code, no run)."""
import shutil

import pytest

from sfclient import lang_layer, start

# SandboxFusion language -> scripts/mk-lang-rootfs.sh's name for its image
# (`mk-lang-rootfs.sh --image LANG`: a test framework runs in its language's)
IMAGE_LANG = {"go": "go", "java": "java", "nodejs": "nodejs", "rust": "rust", "php": "php",
              "lua": "lua", "ruby": "ruby", "R": "r", "perl": "perl", "go_test": "go",
              "junit": "java", "typescript": "nodejs", "jest": "nodejs", "csharp": "csharp",
              "scala": "scala", "racket": "racket", "D_ut": "d", "verilog": "verilog",
              "kotlin_script": "kotlin"}
COMPILED = ("go", "java", "rust", "junit", "csharp", "scala", "D_ut", "verilog")
COMPILE_TIMEOUT = 120  # a JVM or rustc on two cores shared with other builds
RUN_TIMEOUT = 60
TLE_TIMEOUT = 2  # the programs below sleep for an hour: any limit is hit
RUNTIME_RC = {"verilog": 1}  # $fatal's exit status; the others exit(3)

# (hello, stdin echo, "boom" on stderr and exit 3, sleep for an hour,
#  compile error or None); None where the language has no such program (a
#  test framework's output is its report: its cases are in SUITES)
PROGRAMS = {
    "go": (
        'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
        'package main\nimport ("bufio"; "fmt"; "os")\n'
        'func main() { s := bufio.NewScanner(os.Stdin); s.Scan(); fmt.Println(s.Text()) }\n',
        'package main\nimport ("fmt"; "os")\n'
        'func main() { fmt.Fprintln(os.Stderr, "boom"); os.Exit(3) }\n',
        'package main\nimport "time"\nfunc main() { time.Sleep(time.Hour) }\n',
        'package main\nfunc main() { x := ; }\n',
    ),
    "rust": (
        'fn main() { println!("hello"); }\n',
        'fn main() { let mut s = String::new(); std::io::stdin().read_line(&mut s).unwrap();'
        ' print!("{}", s); }\n',
        'fn main() { eprintln!("boom"); std::process::exit(3); }\n',
        'fn main() { std::thread::sleep(std::time::Duration::from_secs(3600)); }\n',
        'fn main() { let x: i32 = "a"; }\n',
    ),
    "java": (
        'public class Main { public static void main(String[] a) {'
        ' System.out.println("hello"); } }\n',
        'import java.io.*;\npublic class Main { public static void main(String[] a)'
        ' throws Exception { BufferedReader r = new BufferedReader(new InputStreamReader('
        'System.in)); System.out.println(r.readLine()); } }\n',
        'public class Main { public static void main(String[] a) {'
        ' System.err.println("boom"); System.exit(3); } }\n',
        'public class Main { public static void main(String[] a) throws Exception {'
        ' Thread.sleep(3600000); } }\n',
        'public class Main { public static void main(String[] a) { int x = "a"; } }\n',
    ),
    "nodejs": (
        'console.log("hello");\n',
        'process.stdout.write(require("fs").readFileSync(0, "utf8"));\n',
        'console.error("boom"); process.exit(3);\n',
        'setTimeout(() => {}, 3600e3);\n',
        None,
    ),
    "php": (
        '<?php echo "hello\\n";\n',
        '<?php echo fgets(STDIN);\n',
        '<?php fwrite(STDERR, "boom\\n"); exit(3);\n',
        '<?php sleep(3600);\n',
        None,
    ),
    "lua": (
        'print("hello")\n',
        'io.write(io.read("l"), "\\n")\n',
        'io.stderr:write("boom\\n") os.exit(3)\n',
        'while true do end\n',  # no sleep in plain lua: the limit stops it
        None,
    ),
    "ruby": (
        'puts "hello"\n',
        'print STDIN.gets\n',
        '$stderr.puts "boom"; exit 3\n',
        'sleep 3600\n',
        None,
    ),
    "R": (
        'cat("hello\\n")\n',
        'cat(readLines(file("stdin"), n = 1), "\\n", sep = "")\n',
        'message("boom"); quit(status = 3)\n',
        'Sys.sleep(3600)\n',
        None,
    ),
    "perl": (
        'print "hello\\n";\n',
        'print scalar <STDIN>;\n',
        'print STDERR "boom\\n"; exit 3;\n',
        'sleep 3600;\n',
        None,
    ),
    "typescript": (
        'const s: string = "hello";\nconsole.log(s);\n',
        'import * as fs from "fs";\nprocess.stdout.write(fs.readFileSync(0, "utf8") as string);\n',
        'console.error("boom");\nprocess.exit(3 as number);\n',
        'setTimeout((): void => {}, 3600e3);\n',
        None,
    ),
    "csharp": (
        'using System;\npublic class Program { public static void Main() {'
        ' Console.WriteLine("hello"); } }\n',
        'using System;\npublic class Program { public static void Main() {'
        ' Console.WriteLine(Console.ReadLine()); } }\n',
        'using System;\npublic class Program { public static void Main() {'
        ' Console.Error.WriteLine("boom"); Environment.Exit(3); } }\n',
        'public class Program { public static void Main() {'
        ' System.Threading.Thread.Sleep(3600000); } }\n',
        'public class Program { public static void Main() { int x = "a"; } }\n',
    ),
    "scala": (
        'object Main {\n  def main(args: Array[String]): Unit = println("hello")\n}\n',
        'object Echo {\n  def main(args: Array[String]): Unit = println(scala.io.StdIn.readLine())\n}\n',
        'object Main {\n  def main(args: Array[String]): Unit = {'
        ' System.err.println("boom"); sys.exit(3) }\n}\n',
        'object Main {\n  def main(args: Array[String]): Unit = Thread.sleep(3600000L)\n}\n',
        'object Main {\n  def main(args: Array[String]): Unit = { val x: Int = "a" }\n}\n',
    ),
    "racket": (
        '#lang racket\n(displayln "hello")\n',
        '#lang racket\n(displayln (read-line))\n',
        '#lang racket\n(eprintf "boom~n")\n(exit 3)\n',
        '#lang racket\n(sleep 3600)\n',
        None,
    ),
    "D_ut": (
        'import std.stdio;\nvoid main() { writeln("hello"); }\n',
        'import std.stdio;\nvoid main() { write(readln()); }\n',
        'import std.stdio;\nimport core.stdc.stdlib : exit;\n'
        'void main() { stderr.writeln("boom"); exit(3); }\n',
        'import core.thread;\nvoid main() { Thread.sleep(dur!"hours"(1)); }\n',
        'void main() { int x = "a"; }\n',
    ),
    "verilog": (  # the top module is tb (-s tb), as SandboxFusion's benchmarks name it
        'module tb;\n  initial $display("hello");\nendmodule\n',
        'module tb;\n  reg [8*64-1:0] line;\n  integer n;\n'
        '  initial begin n = $fgets(line, 32\'h8000_0000); $write("%0s", line); end\nendmodule\n',
        'module tb;\n  initial begin $fdisplay(32\'h8000_0002, "boom"); $fatal(1); end\nendmodule\n',
        'module tb;\n  initial forever #1;\nendmodule\n',
        'module tb;\n  initial x = ;\nendmodule\n',
    ),
    "kotlin_script": (
        'println("hello")\n',
        'println(readLine())\n',
        'System.err.println("boom")\nkotlin.system.exitProcess(3)\n',
        'Thread.sleep(3600000L)\n',
        None,
    ),
    "go_test": (
        None, None, None,
        'package main\nimport ("testing"; "time")\n'
        'func TestSleep(t *testing.T) { time.Sleep(time.Hour) }\n',
        None,
    ),
    "jest": (
        None, None, None,
        "test('sleeps', () => new Promise<void>((r) => setTimeout(r, 3600e3)), 7200e3);\n",
        None,
    ),
    "junit": (
        None, None, None,
        'import org.junit.jupiter.api.Test;\n'
        'class SleepTest { @Test void sleeps() throws Exception { Thread.sleep(3600000); } }\n',
        'import org.junit.jupiter.api.Test;\nclass BadTest { @Test void bad() { int x = "a"; } }\n',
    ),
}

# Test frameworks: (a passing suite, the same suite failing, what the
# failure's report says on stdout or stderr). The suites are shaped as
# SandboxFusion's own: testify for go_test, a public class named apart
# from its file for junit, TypeScript for jest, unittest blocks for D_ut.
SUITES = {
    "go_test": (
        'package main\nimport ("testing"; "github.com/stretchr/testify/assert")\n'
        'func Add(a, b int) int { return a %s b }\n'
        'func TestAdd(t *testing.T) { assert.Equal(t, 3, Add(1, 2)) }\n',
        "Not equal",
    ),
    "junit": (
        'import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n'
        'public class Adder { static int add(int a, int b) { return a %s b; } }\n'
        'class AdderTest { @Test void adds() { assertEquals(3, Adder.add(1, 2)); } }\n',
        "expected: <3> but was: <-1>",
    ),
    "jest": (
        "import { describe, expect, test } from '@jest/globals';\n"
        "function add(a: number, b: number): number { return a %s b; }\n"
        "describe('add', () => { test('adds', () => { expect(add(1, 2)).toBe(3); }); });\n",
        "Expected: 3",
    ),
    "D_ut": (
        'int add(int a, int b) { return a %s b; }\nunittest { assert(add(1, 2) == 3); }\n'
        'void main() {}\n',
        "FAILED unittests",
    ),
}

# The first case's setup imports every built image (up to 17 toolchains,
# GBs of layers, on two shared cores): more than tests/run's 300 s per case
pytestmark = pytest.mark.timeout(1800)

_layers = {}


def cached(lang):
    if lang not in _layers:
        _layers[lang] = lang_layer(IMAGE_LANG[lang])
    return _layers[lang]


def image(lang):
    return "lang-%s:bookworm" % IMAGE_LANG[lang]


@pytest.fixture(scope="module")
def sf(rootfs):
    langs = [l for l in PROGRAMS if cached(l)]
    extra = [a for l in langs for a in ("--compat-image", "%s=%s" % (l, image(l)))]
    d, client = start(rootfs, extra, import_base=False)
    try:
        r = d.cli("image", "defaults", "--quiet", "--lang",
                  ",".join(sorted({IMAGE_LANG[l] for l in langs})), timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        yield client
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture
def sf_lang(request, lang):
    """The module's daemon, after a visible skip for a language whose image
    is not built (before the daemon starts: nothing cached, nothing run)."""
    if not cached(lang):
        pytest.skip("%s not built: warren image defaults --lang %s" % (image(lang), IMAGE_LANG[lang]))
    return request.getfixturevalue("sf")


def run(sf, lang, code, **kw):
    kw.setdefault("compile_timeout", COMPILE_TIMEOUT)
    kw.setdefault("run_timeout", RUN_TIMEOUT)
    return sf.run_code(language=lang, code=code, **kw)


def check_compiled(lang, r):
    if lang in COMPILED:
        assert r["compile_result"]["status"] == "Finished", r
        assert r["compile_result"]["return_code"] == 0, r["compile_result"]["stderr"]
    else:
        assert r["compile_result"] is None, r


def having(i):
    """The languages with a program in PROGRAMS' slot i."""
    return [l for l in PROGRAMS if PROGRAMS[l][i] is not None]


@pytest.mark.parametrize("lang", having(0))
def test_hello(sf_lang, lang):
    r = run(sf_lang, lang, PROGRAMS[lang][0])
    assert r["status"] == "Success", (r["compile_result"] or {}).get("stderr", r)
    check_compiled(lang, r)
    assert r["run_result"]["status"] == "Finished", r
    assert r["run_result"]["return_code"] == 0, r
    assert r["run_result"]["stdout"] == "hello\n", r


@pytest.mark.parametrize("lang", having(1))
def test_stdin(sf_lang, lang):
    r = run(sf_lang, lang, PROGRAMS[lang][1], stdin="65535 warren\n")
    assert r["status"] == "Success", (r["compile_result"] or {}).get("stderr", r)
    assert r["run_result"]["stdout"] == "65535 warren\n", r


@pytest.mark.parametrize("lang", having(2))
def test_runtime_error(sf_lang, lang):
    r = run(sf_lang, lang, PROGRAMS[lang][2])
    assert r["status"] == "Failed", r
    check_compiled(lang, r)
    assert r["run_result"]["status"] == "Finished", r
    assert r["run_result"]["return_code"] == RUNTIME_RC.get(lang, 3), r
    assert "boom" in r["run_result"]["stderr"], r


@pytest.mark.parametrize("lang", having(3))
def test_time_limit(sf_lang, lang):
    r = run(sf_lang, lang, PROGRAMS[lang][3], run_timeout=TLE_TIMEOUT)
    assert r["status"] == "Failed", r
    check_compiled(lang, r)
    assert r["run_result"]["status"] == "TimeLimitExceeded", str(r["run_result"])
    assert r["run_result"]["return_code"] is None, r


@pytest.mark.parametrize("lang", having(4))
def test_compile_error(sf_lang, lang):
    r = run(sf_lang, lang, PROGRAMS[lang][4])
    assert r["status"] == "Failed", r
    assert r["compile_result"]["status"] == "Finished", r
    assert r["compile_result"]["return_code"] != 0, r
    assert r["compile_result"]["stderr"], r
    assert r["run_result"] is None, r


@pytest.mark.parametrize("lang", list(SUITES))
def test_suite_passes(sf_lang, lang):
    r = run(sf_lang, lang, SUITES[lang][0] % "+")
    assert r["status"] == "Success", r
    check_compiled(lang, r)
    assert r["run_result"]["return_code"] == 0, r


@pytest.mark.parametrize("lang", list(SUITES))
def test_suite_fails(sf_lang, lang):
    r = run(sf_lang, lang, SUITES[lang][0] % "-")
    assert r["status"] == "Failed", r
    check_compiled(lang, r)
    assert r["run_result"]["status"] == "Finished", r
    assert r["run_result"]["return_code"] != 0, r
    out = r["run_result"]["stdout"] + r["run_result"]["stderr"]
    assert SUITES[lang][1] in out, r


# A JVM's address space at start, under the call's 1 GB default limit: its
# peak and its heap, printed by the program itself
JVM_PEAK = (
    'import java.nio.file.*;\npublic class Main { public static void main(String[] a)'
    ' throws Exception { for (String l : Files.readAllLines(Paths.get("/proc/self/status")))'
    ' if (l.startsWith("VmPeak:")) System.out.println(l.split("\\\\s+")[1]);'
    ' System.out.println(Runtime.getRuntime().maxMemory() >> 10); } }\n'
)


@pytest.mark.parametrize("lang", ["java"])
def test_jvm_starts_with_room_to_spare(sf_lang, lang):
    """The JVM sized its heap at half the address-space limit and peaked 8 MB
    under it: one more malloc arena as its threads contended and it died at
    start ("insufficient memory"; a JUnit run, 1 in 60). The heap is now a
    third of the limit: at least 200 MB of the 1 GB stays free (about 240 here), and the heap
    keeps more than 300 MB."""
    r = run(sf_lang, lang, JVM_PEAK)
    assert r["status"] == "Success", r
    peak_kb, heap_kb = (int(x) for x in r["run_result"]["stdout"].split())
    assert peak_kb < (1024 - 200) * 1024, r["run_result"]
    assert heap_kb > 300 * 1024, r["run_result"]
