"""Adapted from bytedance/SandboxFusion (Apache-2.0): SandboxFusion's sandbox/tests/runners/test_cpp.py, against Warren over HTTP.
base:bookworm carries g++ (scripts/mk-debian-rootfs.sh)."""

from sfclient import client, sf_daemon  # noqa: F401 (fixtures)


def test_cpp_print(client):
    r = client.run_code(language="cpp", run_timeout=5, code="""
    #include <iostream>

    int main() {
        std::cout << "123" << std::endl;
        return 0;
    }
    """)
    assert r["status"] == "Success"
    assert r["compile_result"]["status"] == "Finished"
    assert r["run_result"]["stdout"].strip() == "123"


def test_cpp_timeout(client):
    r = client.run_code(language="cpp", run_timeout=0.5, compile_timeout=5, code="""
    #include <iostream>
    #include <chrono>
    #include <thread>

    int main() {
        std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        return 0;
    }
    """)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "TimeLimitExceeded"


def test_cpp_assertion_error(client):
    r = client.run_code(language="cpp", code="""
    #include <iostream>
    #include <cassert>

    int main() {
        assert(1 == 2);
        return 0;
    }
    """)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "Finished"
    assert "Assertion" in r["run_result"]["stderr"]


def test_cpp_compile_error(client):
    r = client.run_code(language="cpp", code="""
    int main() {
        object i = ?;
        return 0;
    }
    """)
    assert r["status"] == "Failed"
    assert r["compile_result"]["status"] == "Finished"
    assert r["compile_result"]["return_code"] != 0
    assert r["run_result"] is None


def test_cpp_stdin(client):
    r = client.run_code(language="cpp", run_timeout=5, stdin="65535", code="""
    #include <iostream>

    int main() {
        int num;
        std::cin >> num;
        std::cout << num << std::endl;
        return 0;
    }
    """)
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert r["run_result"]["stdout"] == "65535\n"


PTHREAD = """
#include <memory>
#include <queue>
#include <mutex>
#include <condition_variable>
#include <iostream>
#include <thread>
#include <vector>
#include <optional>

template<typename T>
class ThreadSafeQueue {
public:
    ThreadSafeQueue() = default;

    template<class U>
    auto push(U&& val) -> std::enable_if_t<std::is_same<T, typename std::decay<U>::type>::value> {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_.push(std::forward<U>(val));
        cv_.notify_one();
    }

    std::optional<T> pop() {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this]() { return !queue_.empty(); });
        T value = std::move(queue_.front());
        queue_.pop();
        return value;
    }

    bool empty() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return queue_.empty();
    }

private:
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::queue<T> queue_;
};



void producer(ThreadSafeQueue<int>& queue, int id) {
    for (int i = 0; i < 3; ++i) {
        std::cout << "Producer " << id << " pushing " << i << std::endl;
        queue.push(i);
    }
}

void producer_move(ThreadSafeQueue<std::unique_ptr<int>>& queue, int id) {
    for (int i = 0; i < 3; ++i) {
        std::cout << "Producer " << id << " pushing " << i << std::endl;
        queue.push(std::move(std::make_unique<int>(i)));
    }
}

void consumer(ThreadSafeQueue<int>& queue, int id) {
    for (int i = 0; i < 3; ++i) {
        auto value = queue.pop();
        std::cout << "Consumer " << id << " popped " << *value << std::endl;
    }
}

void consumer_move(ThreadSafeQueue<std::unique_ptr<int>>& queue, int id) {
    for (int i = 0; i < 3; ++i) {
        auto value = queue.pop();
        std::cout << "Consumer " << id << " popped " << *(*value) << std::endl;
    }
}

int main() {
    {
        ThreadSafeQueue<int> queue;

        std::thread producer1(producer, std::ref(queue), 1);
        std::thread producer2(producer, std::ref(queue), 2);
        std::thread consumer1(consumer, std::ref(queue), 1);
        std::thread consumer2(consumer, std::ref(queue), 2);

        producer1.join();
        producer2.join();
        consumer1.join();
        consumer2.join();
    }

    {
        ThreadSafeQueue<std::unique_ptr<int>> queue;

        std::thread producer1(producer_move, std::ref(queue), 1);
        std::thread producer2(producer_move, std::ref(queue), 2);
        std::thread consumer1(consumer_move, std::ref(queue), 1);
        std::thread consumer2(consumer_move, std::ref(queue), 2);

        producer1.join();
        producer2.join();
        consumer1.join();
        consumer2.join();
    }


    return 0;
}
    """


def test_cpp_pthread(client):
    r = client.run_code(language="cpp", code=PTHREAD, run_timeout=2)
    assert r["status"] == "Success", r
    assert r["run_result"]["status"] == "Finished"


def test_cpp_threads_hit_the_wall_clock_limit(client):
    """Warren's own: run_timeout is wall-clock time. Threads spinning on every
    core use CPU time faster than that; the per-process CPU rlimit must not
    end them first (it did at ceil(timeout)+1 s of CPU, and the run came back
    Finished with SIGXCPU: a go_test time-limit case failed so in CI)."""
    r = client.run_code(language="cpp", run_timeout=2, compile_timeout=30, code="""
    #include <thread>
    #include <vector>

    int main() {
        std::vector<std::thread> ts;
        for (int i = 0; i < 4; i++)
            ts.emplace_back([] { for (volatile unsigned long n = 0;; n++) {} });
        for (auto &t : ts) t.join();
    }
    """)
    assert r["status"] == "Failed", r
    assert r["compile_result"]["status"] == "Finished", r
    assert r["run_result"]["status"] == "TimeLimitExceeded", str(r["run_result"])
