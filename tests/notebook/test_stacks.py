"""stacks.py: an armed process writes its main thread's stack on SIGUSR1; the kernel reads it, drops files of
processes that are gone, and removes the rest at stop."""
import subprocess
import sys
import textwrap

from mfsdp_kit.notebook import stacks


def test_an_armed_process_names_where_its_main_thread_waits_and_files_are_cleaned(tmp_path):
    code = textwrap.dedent(f"""
        import threading, time
        from mfsdp_kit.notebook import stacks
        stacks.arm(profile_dir={str(tmp_path)!r}, cluster_id="c1")
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()   # another thread, dumped first
        def waiting_for_the_controller():
            print("armed", flush=True)
            time.sleep(600)
        waiting_for_the_controller()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "armed"
        gone = stacks.folder(str(tmp_path)) / "mfsdp_kit-stacks-c1-999999999.txt"   # a pid no process has
        gone.write_text("")
        other = stacks.folder(str(tmp_path)) / "mfsdp_kit-stacks-c2-1.txt"          # another cluster's: untouched
        other.write_text("")
        where = stacks.describe(profile_dir=str(tmp_path), cluster_id="c1", wait_s=0.5)
        assert where.startswith(f"engine pid {proc.pid}, main thread:") and where.count("engine pid") == 1, where
        assert "in waiting_for_the_controller" in where and not gone.exists() and other.exists()
        assert stacks.describe(profile_dir=str(tmp_path), cluster_id="c3") == ""
    finally:
        proc.kill()
        proc.wait()
    stacks.remove(profile_dir=str(tmp_path), cluster_id="c1")
    assert [p.name for p in stacks.folder(str(tmp_path)).iterdir()] == [other.name]


def test_main_thread_is_the_last_block_of_the_last_dump():
    dump = ("Thread 0x1 (most recent call first):\n  File \"a.py\", line 1 in old\n\n"
            "Current thread 0x2 (most recent call first):\n  File \"b.py\", line 2 in old_main\n"
            "Thread 0x1 (most recent call first):\n  File \"a.py\", line 1 in worker\n\n"
            "Current thread 0x2 (most recent call first):\n" + "".join(f"  File \"m.py\", line {i} in f{i}\n"
                                                                   for i in range(40)))
    lines = stacks.main_thread(dump)
    assert lines[0].startswith("Current thread 0x2") and lines[1].endswith("in f0")
    assert len(lines) == stacks.MAX_LINES and stacks.main_thread("") == ["(wrote nothing: stuck outside Python?)"]
