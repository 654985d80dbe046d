// A test suite whose tests share one fleet: launched before the suite's
// first test with the options `Derived::SuiteOptions()` returns (which may
// write files the fleet needs first), stopped after its last. Each test
// skips without the bundled model and fails with the launch's error if the
// fleet did not start. A suite with more to clean up hides
// TearDownTestSuite and calls this one's.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "fleet_harness.h"

namespace tandem::testing {

template <typename Derived>
class SharedFleetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!HaveBundledModel()) return;
    Result<FleetOptions> options = Derived::SuiteOptions();
    if (!options.ok()) {
      launch_error_ = options.status().ToString();
      return;
    }
    auto f = Fleet::Launch(*options);
    if (f.ok()) {
      fleet_ = f->release();
    } else {
      launch_error_ = f.status().ToString();
    }
  }
  static void TearDownTestSuite() {
    delete fleet_;
    fleet_ = nullptr;
  }
  void SetUp() override {
    if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
    ASSERT_NE(fleet_, nullptr) << (launch_error_.empty() ? "no fleet" : launch_error_);
  }

  static inline Fleet* fleet_ = nullptr;
  static inline std::string launch_error_;
};

}  // namespace tandem::testing
